"""The safetensors db_type stores torch tensors, also inside state dicts, as real named
tensors of their own dtype: safetensors alone reads them, bit for bit, under
``<blob>/<state-dict key>``; epochal still reads every blob back exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from epochal import get_db_type  # noqa: E402


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied


def model_and_opt():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    return m, opt


def test_tensors_in_state_dicts_are_real_named_tensors(tmp_path):
    m, opt = model_and_opt()
    f8 = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    path = str(tmp_path / "db")
    get_db_type("safetensors").write(path, {"model": m, "opt": opt, "t": torch.arange(6).reshape(2, 3),
                                           "extra": {"scale": torch.ones(2, dtype=torch.float16), "f8": f8}})
    got = load_file(path)  # safetensors alone, no epochal
    for k, v in m.state_dict().items():
        assert got[f"model/{k}"].dtype == torch.bfloat16 and torch.equal(got[f"model/{k}"], v), k
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(got[f"opt/state/{pid}/{k}"], v), (pid, k)
    assert torch.equal(got["t"], torch.arange(6).reshape(2, 3))
    assert got["extra/scale"].dtype == torch.float16
    assert got["extra/f8"].dtype == torch.float8_e4m3fn
    assert got["extra/f8"].view(torch.uint8).tolist() == f8.view(torch.uint8).tolist()
    assert not [k for k in got if k.startswith("__epochal__/")]  # nothing hidden but small metadata
    # and epochal reads everything back exactly
    back = get_db_type("safetensors").read(path)
    for k, v in m.state_dict().items():
        assert torch.equal(back["model"][k], v)
    assert back["opt"]["param_groups"] == opt.state_dict()["param_groups"]


def test_a_tied_tensor_is_stored_once_and_stays_tied(tmp_path):
    m = Tied()
    path = str(tmp_path / "db")
    get_db_type("safetensors").write(path, {"lm": m})
    got = load_file(path)
    assert sorted(got) == ["lm/emb.weight"]  # the alias is not a second copy
    live = Tied()
    back = get_db_type("safetensors").read(path, existing={"lm": live})["lm"]
    assert back is live and live.head.weight is live.emb.weight
    assert torch.equal(live.emb.weight, m.emb.weight)


def test_a_taken_name_falls_back_to_a_hidden_tensor(tmp_path):
    m, _ = model_and_opt()
    path = str(tmp_path / "db")
    import numpy as np

    get_db_type("safetensors").write(path, {"model/0.bias": np.arange(3.0), "model": m})
    got = load_file(path)
    assert got["model/0.bias"].dtype == torch.float64  # the ndarray blob keeps its name
    back = get_db_type("safetensors").read(path)
    assert torch.equal(back["model"]["0.bias"], m.state_dict()["0.bias"])
    assert back["model/0.bias"].tolist() == [0.0, 1.0, 2.0]
