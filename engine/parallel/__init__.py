"""Multi-process execution: the rank launcher (launch.py), the (pp, ep, tp) process
groups (groups.py), what a layer split over TP ranks takes from its plan
(tensor.py), the MoE token exchange of both forward paths (a2a.py) and pipeline
point-to-point transfers (p2p.py), the stage driver that makes a pipeline stage run
like the whole model on every rank (pipeline.py), and the process's parallel context
that MoE layers take their EP group from at build time (context.py).

Nothing here reads a backend name: callers pick the forward path from the plan.
Import from the modules (`from loadplan.engine.parallel.launch import launch`): the
package does not re-export, so `launch` the function never shadows `launch` the module.
"""
