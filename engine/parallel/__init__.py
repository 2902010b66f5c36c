"""Multi-process execution: the rank launcher (launch.py), the (pp, ep) process
groups (groups.py), the MoE token exchange of both forward paths (a2a.py) and
pipeline point-to-point transfers (p2p.py).

Nothing here reads a backend name: callers pick the forward path from the plan.
Import from the modules (`from loadplan.engine.parallel.launch import launch`): the
package does not re-export, so `launch` the function never shadows `launch` the module.
"""
