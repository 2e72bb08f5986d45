"""The state of the process's random generators as a checkpointable, pickle-free blob.

Put ``ws["rng"] = epochal.RNGState()`` in the session workspace before training: every
checkpoint then records the generators as they were after that epoch, and a resumed run
restores them, so data shuffling, dropout masks and augmentation continue exactly where the
killed run left off (a condition for bit-identical resumes).

Captured, each as plain data (ints, floats, arrays, tensors) that the tree codec stores raw:

* Python's ``random`` module (``random.getstate()``);
* numpy's global generator (``np.random.get_state()``, the legacy MT19937 ``RandomState``);
* when torch is already imported: torch's CPU generator and, when CUDA is available, every
  CUDA device's generator. torch is never imported just to look.
"""

from __future__ import annotations

import random
import sys
import warnings
from typing import Any

import numpy as np

__all__ = ["RNGState"]


class RNGState:
    """A stateful blob whose state dict is the global random generators' state.

    ``state_dict()`` captures the generators now; ``load_state_dict(state)`` sets them. The
    object holds nothing itself, so one instance can stay in the workspace for the whole run.

    Args:
        python: capture Python's ``random`` module.
        numpy: capture numpy's global generator.
        torch: capture torch's CPU and CUDA generators; ``None`` (default) means "when torch is
            imported". ``True`` imports torch if needed.
    """

    def __init__(self, *, python: bool = True, numpy: bool = True, torch: bool | None = None):
        self.python = python
        self.numpy = numpy
        self.torch = torch

    def __repr__(self) -> str:
        return f"RNGState(python={self.python}, numpy={self.numpy}, torch={self.torch})"

    def _torch_module(self) -> Any:
        if self.torch is False:
            return None
        if self.torch is None and "torch" not in sys.modules:
            return None
        import torch

        return torch

    def state_dict(self) -> dict[str, Any]:
        """The generators' current state as nested plain data (no objects, no pickle)."""
        state: dict[str, Any] = {}
        if self.python:
            version, internal, gauss_next = random.getstate()
            state["python"] = {"version": version, "state": list(internal), "gauss": gauss_next}
        if self.numpy:
            kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            state["numpy"] = {
                "kind": str(kind),
                "keys": np.array(keys, dtype=np.uint32),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        torch = self._torch_module()
        if torch is not None:
            tstate: dict[str, Any] = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                tstate["cuda"] = list(torch.cuda.get_rng_state_all())
            state["torch"] = tstate
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every generator recorded in ``state``; generators it lacks are left alone.

        Raises ValueError on a state of the wrong form (nothing is set then for that part).
        """
        if not isinstance(state, dict):
            raise ValueError(f"an RNG state must be a dict, not {type(state).__name__}")
        py = state.get("python")
        if py is not None:
            try:
                internal = tuple(int(x) for x in py["state"])
                gauss = py["gauss"]
                random.setstate((int(py["version"]), internal, gauss))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"bad Python random state: {e}") from e
        npst = state.get("numpy")
        if npst is not None:
            try:
                np.random.set_state(
                    (
                        str(npst["kind"]),
                        np.asarray(npst["keys"], dtype=np.uint32),
                        int(npst["pos"]),
                        int(npst["has_gauss"]),
                        float(npst["cached_gaussian"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"bad numpy random state: {e}") from e
        tst = state.get("torch")
        if tst is not None:
            import torch  # the state holds tensors, so torch is already imported

            torch.set_rng_state(tst["cpu"].cpu())
            cuda = tst.get("cuda") or []
            if cuda:
                if not torch.cuda.is_available():
                    warnings.warn(
                        "the checkpoint holds CUDA generator states but CUDA is not available; "
                        "they are not restored",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                else:
                    n = torch.cuda.device_count()
                    if n != len(cuda):
                        warnings.warn(
                            f"the checkpoint holds {len(cuda)} CUDA generator states, this "
                            f"process has {n} devices; restoring the first {min(n, len(cuda))}",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    for i, s in enumerate(cuda[:n]):
                        torch.cuda.set_rng_state(s.cpu(), i)
