"""The controller: the process that owns the meshes of one run and wires their loops.

loop.py is the training loop (`RLLoop`: start, step, health, shutdown), read top to
bottom; what it calls lives beside it: replicas.py starts, watches and replaces the
generator replicas, scorers and rollout workers, including the OS-level clean-up a killed
proc leaves behind; colocate.py is placement=colocate's turn-taking on shared devices;
collect.py gathers each step's metrics row (meshrl/metrics.py writes it); breaker.py stops
a run whose episodes all fail and prints the cliff alarm; checkpoint.py saves, restores and
exports; evaluation.py evaluates held-out prompts beside training and on a saved checkpoint
(`meshrl eval`); control.py holds the Session's calls between steps. The controller is
never on the data path.
"""
