"""ShownTensors: a checkpoint shown under other names, some tensors through a function of them."""

from __future__ import annotations

import torch

from loadplan.engine.shown_tensors import ShownTensors, renamed, rows_by_rank


class FakeCheckpoint:
    """names/shape/get over a dict, counting reads."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.reads: list[str] = []

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        self.reads.append(name)
        return self.tensors[name]


def test_a_tensor_shown_whole_and_one_shown_in_parts_read_once_for_all_its_parts():
    ckpt = FakeCheckpoint({"fused": torch.arange(12.).view(6, 2), "norm": torch.ones(2)})
    view = ShownTensors(ckpt)
    view.show("model.norm.weight", "norm")
    for part, lo in (("a", 0), ("b", 2), ("c", 4)):
        view.show(f"proj.{part}", "fused", (2, 2), lambda t, lo=lo: t[lo:lo + 2])
    assert view.names() == ["model.norm.weight", "proj.a", "proj.b", "proj.c"]
    assert view.shape("proj.b") == (2, 2) and view.shape("model.norm.weight") == (2,)
    assert torch.equal(view.get("proj.c"), torch.tensor([[8., 9.], [10., 11.]]))
    assert torch.equal(view.get("proj.a"), torch.tensor([[0., 1.], [2., 3.]]))
    assert view.get("proj.b").is_contiguous()
    assert ckpt.reads == ["fused"]                                     # the parts share one read
    assert torch.equal(view.get("model.norm.weight"), torch.ones(2))
    assert view.source_name("proj.b") == "fused" and view.source_name("unknown") == "unknown"


def test_renamed_replaces_the_first_matching_prefix_only():
    ckpt = FakeCheckpoint({"model.language_model.layers.0.w": torch.zeros(1), "lm_head.weight": torch.zeros(1),
                           "model.visual.x": torch.zeros(1)})
    view = renamed(ckpt, (("model.language_model.", "language_model.model."), ("model.", "other."),
                          ("lm_head.", "language_model.lm_head.")))
    assert view.names() == ["language_model.model.layers.0.w", "language_model.lm_head.weight", "other.visual.x"]
    assert view.source_name("other.visual.x") == "model.visual.x"


def test_a_view_over_a_view_names_the_checkpoints_own_tensor():
    ckpt = FakeCheckpoint({"backbone.w": torch.zeros(1)})
    inner = renamed(ckpt, (("backbone.", "model."),))
    outer = ShownTensors(inner)
    outer.show("model.v", "model.w")
    assert outer.source_name("model.v") == "backbone.w"


def test_rows_by_rank_lays_each_ranks_share_of_every_part_together_and_repeats_whole_parts():
    """Parts [a (4 rows) | b (2, whole on every rank) | c (2)] over 2 ranks: [a_0 b c_0 | a_1 b c_1]; only the tensors
    of the given suffixes under the given prefixes, and only where their rows are the parts' sum."""
    t = torch.arange(8.)[:, None]
    ckpt = FakeCheckpoint({"l.0.m.w": t, "l.1.m.w": t, "other.m.w": t, "l.0.m.short": t[:5], "l.0.m.x": t})
    layout = ([4, 2, 2], [False, True, False])
    view = rows_by_rank(ckpt, 2, {"m.w": layout, "m.short": layout}, ("l.0.", "l.1."))
    assert view.shape("l.0.m.w") == (10, 1)
    assert view.get("l.1.m.w").flatten().tolist() == [0, 1, 4, 5, 6, 2, 3, 4, 5, 7]
    for untouched in ("other.m.w", "l.0.m.short", "l.0.m.x"):
        assert torch.equal(view.get(untouched), ckpt.tensors[untouched])
