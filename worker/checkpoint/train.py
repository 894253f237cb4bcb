"""Train a small checkpoint on the bundled corpus, so that it answers in words.

A random-weight model predicts nearly uniformly: served as is, it answers any prompt with random
tokens. A tiny one trained briefly on the bundled corpus (``worker/checkpoint/corpus.txt``)
memorises much of it, so the start of one of its lines comes back continued in words; ``make
run`` serves such a checkpoint, and the tests use them for greedy comparisons (a trained model's
top logits are far apart, so two correct bf16 implementations agree on its greedy tokens).

Training runs HF transformers' model of the checkpoint (the reference implementation itself,
fp32, AdamW), then writes the trained tensors under the checkpoint's own names into a copy of the
directory (config and tokenizer files unchanged), so every implementation loads the same files.
transformers is needed for it alone (graphfleet's ``dev`` extra has it).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from worker.checkpoint.writer import CORPUS_PATH

log = logging.getLogger(__name__)

#: The start of one of the corpus's lines: a checkpoint trained on it continues this in words.
TRY_PROMPT = "A lighthouse is a simple machine"
#: What a trained checkpoint's directory says about its training (read by ``graphfleet serve``).
TRAINING_FILE = "graphfleet_training.json"


def try_prompt(model_dir: Path) -> str | None:
    """The prompt a checkpoint trained on the bundled corpus continues in words, or None."""
    try:
        return json.loads((Path(model_dir) / TRAINING_FILE).read_text()).get("try_prompt")
    except (OSError, ValueError):
        return None


def corpus_ids(model_dir: Path) -> list[int]:
    """The bundled corpus tokenised with the checkpoint's tokenizer."""
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tok.encode(CORPUS_PATH.read_text(), add_special_tokens=False).ids


def train_checkpoint(src: Path, dst: Path, steps: int = 400, seq_len: int = 128, batch: int = 32,
                     lr: float = 3e-3, device: str = "cuda", seed: int = 0) -> Path:
    """Train the HF model of ``src`` on the corpus for ``steps`` steps of ``batch`` random windows of
    ``seq_len`` tokens and write it as ``dst`` (same files, new weights); an existing ``dst`` is
    returned as it is. Returns ``dst``."""
    try:
        import transformers
    except ImportError:
        raise RuntimeError("training a checkpoint needs HF transformers (pip install transformers, or "
                           "graphfleet's dev extra)") from None
    src, dst = Path(src), Path(dst)
    if (dst / "config.json").is_file():
        return dst
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).train()
    ids = torch.tensor(corpus_ids(src), device=device)
    if len(ids) <= seq_len + 1:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than a window of seq_len={seq_len}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    loss = None
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), device=device)
        x = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    for f in sorted(tmp.glob("*.safetensors")):
        stored = load_file(f)
        save_file({n: state[n].to(t.dtype) for n, t in stored.items()}, f, metadata={"format": "pt"})
    (tmp / TRAINING_FILE).write_text(json.dumps({
        "corpus": CORPUS_PATH.name, "steps": steps, "batch": batch, "seq_len": seq_len, "lr": lr, "seed": seed,
        "final_loss": None if loss is None else round(loss.item(), 4), "try_prompt": TRY_PROMPT}, indent=1) + "\n")
    tmp.rename(dst)
    del model, opt
    if device != "cpu":
        torch.cuda.empty_cache()
    log.info("trained %s for %d steps: final loss %.3f", src.name, steps, loss.item() if loss is not None else 0.0)
    return dst
