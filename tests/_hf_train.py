"""A tiny Hugging Face Trainer run for tests/test_hf_trainer.py and bench/bench_hf.py: a GPT-2
built from a config (no download), dropout on, AdamW + linear warmup, random tokens.

As a script: ``python _hf_train.py OUT_DIR {epochal|hf} MAX_STEPS SAVE_STEPS [resume]``; with
``HF_TEST_SLEEP_IN_SAVE=N`` the epochal Trainer prints ``SAVING N`` and sleeps inside the save
of step N (after the model files, before its db: a kill there is a kill mid-save); with
``HF_TEST_NO_PICKLE=1`` pickle and torch.load raise; with ``HF_TEST_SLOW_STEPS=1`` each
step prints ``STEP n`` and sleeps 0.1 s (room for a kill at a random moment). Prints ``DONE <sha256 of the params>``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402


class TokenSet(torch.utils.data.Dataset):
    def __init__(self, n: int = 40, seq: int = 16, vocab: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(n_embd: int = 32, n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(cfg)


def make_trainer(out: str, kind: str, max_steps: int, save_steps: int, callbacks=(), model=None,
                 dataset=None, eval_dataset=None, **extra):
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments

    from epochal.integrations.transformers import Trainer as EpochalTrainer

    torch.set_num_threads(1)
    kw = dict(output_dir=out, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
              per_device_train_batch_size=4, learning_rate=1e-3, weight_decay=0.01, warmup_steps=2,
              report_to="none", use_cpu=True, seed=0, logging_steps=1000, disable_tqdm=True,
              dataloader_num_workers=0)
    kw.update(extra)
    args = TrainingArguments(**kw)
    cls = EpochalTrainer if kind == "epochal" else HFTrainer
    if kind == "epochal" and os.environ.get("HF_TEST_SLEEP_IN_SAVE"):
        at = int(os.environ["HF_TEST_SLEEP_IN_SAVE"])

        class SlowTrainer(EpochalTrainer):
            def _epochal_write(self, backend, path, blobs):
                if self.state.global_step == at:
                    print(f"SAVING {at}", flush=True)
                    time.sleep(120)
                super()._epochal_write(backend, path, blobs)

        cls = SlowTrainer
    return cls(model=model if model is not None else make_model(), args=args,
               train_dataset=dataset if dataset is not None else TokenSet(), eval_dataset=eval_dataset,
               callbacks=list(callbacks))


def params_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _forbid_pickle() -> None:
    import pickle

    def refuse(*a, **k):
        raise RuntimeError("pickle used on the load path")

    pickle.load = pickle.loads = refuse  # type: ignore[assignment]
    pickle.Unpickler = refuse  # type: ignore[assignment,misc]
    torch.load = refuse  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    out, kind, max_steps, save_steps = argv[0], argv[1], int(argv[2]), int(argv[3])
    resume = len(argv) > 4 and argv[4] == "resume"
    callbacks = []
    if os.environ.get("HF_TEST_SLOW_STEPS"):
        from transformers import TrainerCallback

        class Slow(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                print(f"STEP {state.global_step}", flush=True)
                time.sleep(0.1)

        callbacks.append(Slow())
    trainer = make_trainer(out, kind, max_steps, save_steps, callbacks=callbacks)
    if os.environ.get("HF_TEST_NO_PICKLE"):
        _forbid_pickle()
    trainer.train(resume_from_checkpoint=True if resume else None)
    print("DONE", params_digest(trainer.model), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
