"""`loadplan serve` whose ResolveLoadPlan does no rules work: the floor the database write path sets.

    python bench/floor_server.py serve --db URL --listen ADDR     (what `bench/registry.py --floor` runs)

Not a registry to run. The first resolve of each request shape (its configs, parallel and runtime) goes the real
way; every later one of that shape copies that plan with its own request id, deployment id and a new plan id
(no validation, no rules, no fingerprint: the copy keeps the first one's), saves it through the same store
(the same group commit and statement as the real server: a plan row, and a pin for a new deployment) and
answers a LoadPlan holding only its plan id and request id (no encoding). What bench/registry.py measures
against it is the resolve/echo ratio of a registry whose own work on a resolve costs nothing but the save.
"""

from __future__ import annotations

import sys

from loadplan.service.registry import new_plan_id
from loadplan.service.transport import convert, servicer
from loadplan.v1 import registry_pb2 as pb

_FIRST: dict[tuple, object] = {}     # request shape -> the first NewPlan of that shape, resolved the real way


def _copy(obj, **fields):
    """A frozen dataclass's copy with `fields` replaced, without its constructor's checks."""
    copy = object.__new__(type(obj))
    copy.__dict__.update(obj.__dict__, **fields)
    return copy


def _as_saved(new, plan):
    """The answer `save_made` returns: the plan the store answered (its id and request id are sent)."""
    return plan


async def resolve_without_rules(self, request, context):
    shape = (request.config_json, request.quantization_config_json, request.parallel.SerializeToString(),
             request.runtime.SerializeToString(), request.role, request.host, request.quantization)
    first = _FIRST.get(shape)
    if first is None:
        new = self.registry.new_plan(convert.request_from_pb(request),
                                     (request.config_json, request.quantization_config_json),
                                     convert.stored_config_texts(request))
        _FIRST[shape] = new             # before the save: the next of its shape may arrive while this one waits
    else:
        req = _copy(first.plan.request, request_id=request.request_id, deployment_id=request.deployment_id)
        new = _copy(first, plan=_copy(first.plan, plan_id=new_plan_id(), request=req))
    plan = await self._save_made(lambda: new, _as_saved)
    return pb.LoadPlan(plan_id=plan.plan_id, request_id=plan.request.request_id).SerializeToString()


def main() -> int:
    servicer.ModelRegistryServicer.ResolveLoadPlan = servicer._rpc(resolve_without_rules)
    from loadplan.cli.main import main as cli

    return cli()


if __name__ == "__main__":
    sys.exit(main())
