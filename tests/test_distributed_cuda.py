"""CUDA tensors through the DistributedCheckpointer (one process, no process group): saved
synchronously and with async_save (snapshotted through pinned host memory), restored bit for
bit onto their live device. Skipped without a GPU (CI has none); bench/gpu_check.py runs the
same checks and an FSDP2 model on an accelerator machine."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch==2.13.0) is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _torch_bits import bits  # noqa: E402

from epochal.integrations.distributed import DistributedCheckpointer  # noqa: E402


@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_tensors_round_trip_bit_exact_on_their_device(tmp_path: Path, async_save: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
    extra = torch.randn(33, 7, device="cuda").to(torch.bfloat16)
    want = {k: bits(v.cpu()) for k, v in model.state_dict().items()} | {"extra": bits(extra.cpu())}
    with DistributedCheckpointer(tmp_path, async_save=async_save) as ck:
        ck.save(1, {"model": model, "opt": opt, "extra": extra})
        with torch.no_grad():  # the live tensors change right after save() returned
            for p in model.parameters():
                p.add_(1.0)
            extra.add_(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    into = torch.zeros(33, 7, device="cuda", dtype=torch.bfloat16)
    state = {"model": fresh, "opt": torch.optim.Adam(fresh.parameters()), "extra": into}
    with DistributedCheckpointer(tmp_path) as ck:
        assert ck.restore(state) == 1
    got = {k: bits(v.cpu()) for k, v in fresh.state_dict().items()} | {"extra": bits(into.cpu())}
    assert got == want
    assert all(v.is_cuda for v in fresh.state_dict().values()) and into.is_cuda
