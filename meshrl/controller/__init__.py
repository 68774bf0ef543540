"""The controller: the process that owns the meshes of one run and wires their loops.

loop.py is the training loop (`RLLoop`); replicas.py starts, watches and replaces the
generator replicas and rollout workers, including the OS-level clean-up a killed proc
leaves behind; evaluation.py evaluates held-out prompts beside training and on a saved
checkpoint (`meshrl eval`). The controller is never on the data path.
"""
