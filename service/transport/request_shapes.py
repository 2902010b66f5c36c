"""`RequestShapes`: the resolves a server has decided, by request shape, so the next request of a
shape is not decided again.

A request's shape is all of it but its request id and deployment id. The ranks of a deployment
repeat a few shapes (a rank and a role each), and every deployment of one model and layout the
same ones: under a fleet start nearly every resolve has a known shape. It then gets the earlier
plan's decisions, inputs and config texts (`Registry.new_plan_like`, which checks its two ids) and
the earlier answer's encoded runs (`PlanTemplate`): no config parsing, no rules, no fingerprint
of its configs, and an answer of four fields of its own. Only a shape that was decided is
remembered (a refusal never is), and what is remembered is bounded by count and by bytes (a
shape holds its request's config texts).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...plan import LoadPlan
from ...v1 import registry_pb2 as pb
from ..registry import NewPlan
from .plan_wire import PlanTemplate, plan_bytes


def shape_key(request: pb.ResolveLoadPlanRequest) -> bytes:
    """The request's bytes without its two ids, as protobuf writes the parsed message again (fields
    in number order, unknown ones last), so two requests of one shape have one key however their
    clients wrote them. The request is left as it was."""
    request_id, deployment_id = request.request_id, request.deployment_id
    request.ClearField("request_id")
    request.ClearField("deployment_id")
    try:
        return request.SerializeToString(deterministic=True)
    finally:
        request.request_id, request.deployment_id = request_id, deployment_id


@dataclass(frozen=True, slots=True)
class Shape:
    first: NewPlan            # the plan the first request of the shape got (`Registry.new_plan`)
    template: PlanTemplate    # its answer's runs, for every later plan of the shape

    def answer(self, new: NewPlan, plan: LoadPlan) -> bytes:
        """The answer's bytes for `plan`, what the store answered for `new` (a plan made like `first`):
        from the template when it is `new`'s, else (a stored plan replayed) encoded whole."""
        return self.template.bytes(plan) if plan is new.plan else plan_bytes(plan)


class RequestShapes:
    """Shapes by `shape_key`, forgotten all at once when more than `maxsize` or `max_bytes` of keys
    are held (as `service.memo`'s memos: a fleet has few shapes, and a miss only costs the
    resolve what it costs without this). A fleet's shapes (a few models, a rank and role each)
    take a few MB of keys; a shape also holds its parsed configs, several times their text, so
    the bytes bound is what bounds memory when clients send many distinct large configs."""

    def __init__(self, maxsize: int = 4096, max_bytes: int = 16 << 20):
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._shapes: dict[bytes, Shape] = {}
        self._bytes = 0

    def get(self, key: bytes) -> Shape | None:
        return self._shapes.get(key)

    def remember(self, key: bytes, first: NewPlan) -> None:
        """`first`: what `Registry.new_plan` made of a request whose `shape_key` is `key`."""
        if len(key) > self.max_bytes or key in self._shapes:
            return
        if len(self._shapes) >= self.maxsize or self._bytes + len(key) > self.max_bytes:
            self._shapes.clear()
            self._bytes = 0
        self._shapes[key] = Shape(first, PlanTemplate(first.plan, config_json=first.config_json,
                                                      quantization_config_json=first.quantization_config_json,
                                                      unstamped=first.unstamped))
        self._bytes += len(key)

    def __len__(self) -> int:
        return len(self._shapes)
