"""The controller: the process that owns the meshes of one run and wires their loops.

loop.py is the training loop (`RLLoop`); replicas.py starts, watches and replaces the
generator replicas and rollout workers, including the OS-level clean-up a killed proc
leaves behind. The controller is never on the data path.
"""
