"""Tiny checkpoints briefly trained on the bundled corpus, for greedy comparisons in bf16.

Random-weight models predict nearly uniformly: the top-2 logit gap of ~1000 random logits is
about a quarter of their spread, and two correct bf16 implementations (HF's and ours round
differently) disagree by about 1% of it, so greedy tokens flip between them at a few percent
of positions. Trained language models are decisive. This trains the tiny checkpoint with HF
transformers (the reference implementation itself, fp32, AdamW) until it has memorised much of
the corpus, then writes the trained tensors under the checkpoint's own names into a copy of the
directory (config and tokenizer files unchanged), so both implementations load the same files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from worker.checkpoint.writer import CORPUS_PATH


def corpus_ids(model_dir: Path) -> list[int]:
    """The bundled corpus tokenised with the checkpoint's tokenizer."""
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return tok.encode(CORPUS_PATH.read_text(), add_special_tokens=False).ids


def corpus_prompts(model_dir: Path, lengths: list[int], seed: int) -> list[list[int]]:
    """Windows of the corpus of the given lengths, at seeded random offsets."""
    ids = corpus_ids(model_dir)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - max(lengths) - 1, (len(lengths),), generator=g).tolist()
    return [ids[s:s + n] for s, n in zip(starts, lengths)]


def train_checkpoint(src: Path, dst: Path, steps: int = 400, seq_len: int = 128, batch: int = 32,
                     lr: float = 3e-3, device: str = "cuda", seed: int = 0) -> Path:
    """Train the HF model of ``src`` on the corpus and write it as ``dst`` (same files, new weights)."""
    import transformers

    src, dst = Path(src), Path(dst)
    if (dst / "config.json").is_file():
        return dst
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(device).train()
    ids = torch.tensor(corpus_ids(src), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
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
    tmp.rename(dst)
    del model, opt
    torch.cuda.empty_cache()
    print(f"trained {src.name} for {steps} steps: final loss {loss.item():.3f}")
    return dst
