"""Point-to-point transfer of hidden states between pipeline stages.

Shape-agnostic: the sender first sends a fixed-size int64 header (count, then per
tensor its dtype code, ndim and shape), then the tensors, so the receiver needs to
know nothing in advance (prefill and decode steps have different token counts).
Ranks are world ranks (`Grid.next_stage_rank` / `prev_stage_rank`).
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8)
MAX_NDIM = 6
MAX_TENSORS = 8
_SLOT = 2 + MAX_NDIM                      # dtype code, ndim, shape...
_HEADER = 1 + MAX_TENSORS * _SLOT


def _device():
    from .launch import rank_device

    return rank_device()


def send_tensors(tensors: list[torch.Tensor], dst: int, group=None) -> None:
    """Send a list of tensors (any shapes, dtypes in _DTYPES) to world rank `dst`."""
    import torch.distributed as dist

    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors per send, got {len(tensors)}")
    dev = _device()
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _DTYPES:
            raise ValueError(f"dtype {t.dtype} not supported; supported: {[str(d) for d in _DTYPES]}")
        if t.dim() > MAX_NDIM:
            raise ValueError(f"at most {MAX_NDIM} dims, got shape {tuple(t.shape)}")
        base = 1 + i * _SLOT
        header[base] = _DTYPES.index(t.dtype)
        header[base + 1] = t.dim()
        header[base + 2: base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header.to(dev), dst, group=group)
    for t in tensors:
        if t.numel():
            dist.send(t.detach().contiguous().to(dev), dst, group=group)


def recv_tensors(src: int, group=None, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Receive what `send_tensors` sent from world rank `src`."""
    import torch.distributed as dist

    dev = _device()
    header = torch.empty(_HEADER, dtype=torch.int64, device=dev)
    dist.recv(header, src, group=group)
    header = header.cpu().tolist()
    out = []
    for i in range(header[0]):
        base = 1 + i * _SLOT
        dtype, ndim = _DTYPES[header[base]], header[base + 1]
        t = torch.empty(header[base + 2: base + 2 + ndim], dtype=dtype, device=dev)
        if t.numel():
            dist.recv(t, src, group=group)
        out.append(t if device is None else t.to(device))
    return out


def send_tensor(t: torch.Tensor, dst: int, group=None) -> None:
    send_tensors([t], dst, group)


def recv_tensor(src: int, group=None, device: torch.device | str | None = None) -> torch.Tensor:
    (t,) = recv_tensors(src, group, device)
    return t
