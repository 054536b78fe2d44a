"""A small Llama-style model trained here, so that benchmarks comparing next-token distributions see
peaked ones: the embedded default model has random weights, and its distributions are nearly flat.

The model is the default model's architecture (4 layers of 256, rotary positions, 2,048 positions, its
1,024-token tokenizer) trained with AdamW on next-token loss over `sidecar/default_model/corpus.txt`, the
text the tokenizer was trained on. The corpus's last `held_out` tokens are never trained on: benchmarks
read them. It is built once into the sidecar's cache directory (SIDECAR_CACHE_DIR, as the default
model), in a directory named by a fingerprint of the settings, and loaded back with `Engine.load`.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sidecar import Engine, default_model

CORPUS = default_model.HERE / "corpus.txt"


@dataclass(frozen=True)
class Training:
    """Everything the trained weights depend on; the cached directory is named after it.

    Training stops by steps, not by the clock, so that one setting always names the same weights. 150
    steps take about 3 minutes on 2 CPU cores."""

    steps: int = 120
    seq_len: int = 1024  # the benchmarks' window: rotary attention is trained at the distances it is read at
    batch: int = 2
    lr: float = 2e-3
    warmup: int = 15
    weight_decay: float = 0.1
    held_out: int = 4608  # enough for a 1,024-token window slid 12 times by 256, then 16 tokens more
    seed: int = 20261122

    def fingerprint(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        digest.update(default_model.fingerprint().encode())
        digest.update(CORPUS.read_bytes())
        return digest.hexdigest()[:16]


def corpus_split(tokenizer, training: Training) -> tuple[list[int], list[int]]:
    """The corpus's token ids: the part trained on, and the held-out tail."""
    ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    return ids[: -training.held_out], ids[-training.held_out :]


def learning_rate(step: int, training: Training) -> float:
    """Linear warm-up, then a cosine down to a tenth: a short run still ends on small steps."""
    if step < training.warmup:
        return training.lr * (step + 1) / training.warmup
    progress = (step - training.warmup) / max(1, training.steps - training.warmup)
    return training.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(model, ids: list[int], training: Training) -> list[float]:
    """Trains `model` in place on windows of `ids` at random offsets; the loss of every step."""
    data = torch.tensor(ids)
    generator = torch.Generator().manual_seed(training.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=training.weight_decay,
                                  betas=(0.9, 0.95))
    model.train()
    losses = []
    for step in range(training.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, training)
        starts = torch.randint(0, len(data) - training.seq_len, (training.batch,), generator=generator)
        batch = torch.stack([data[s : s + training.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@torch.no_grad()
def held_out_figures(model, ids: list[int], seq_len: int) -> tuple[float, float]:
    """Mean next-token loss and entropy (nats) over `ids`, read in windows of `seq_len`."""
    losses, entropies = [], []
    for start in range(0, len(ids) - 1, seq_len):
        chunk = torch.tensor([ids[start : start + seq_len + 1]])
        logprobs = model(input_ids=chunk[:, :-1]).logits[0].float().log_softmax(-1)
        losses.append(-logprobs.gather(-1, chunk[0, 1:, None]).squeeze(-1))
        entropies.append(-(logprobs.exp() * logprobs).sum(-1))
    return float(torch.cat(losses).mean()), float(torch.cat(entropies).mean())


def build(target: Path, training: Training) -> None:
    """Trains the model and writes it, the default model's tokenizer files and `training.json` into `target`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = default_model.materialise()
    tokenizer = Engine.load(source).tokenizer
    trained_on, held_out = corpus_split(tokenizer, training)
    config = LlamaConfig(**{k: v for k, v in default_model.CONFIG.items() if k != "model_type"},
                         vocab_size=len(tokenizer))
    with torch.random.fork_rng():
        torch.manual_seed(training.seed)
        model = LlamaForCausalLM(config)
        start = time.perf_counter()
        losses = train(model, trained_on, training)
        seconds = time.perf_counter() - start
    loss, entropy = held_out_figures(model, held_out, training.seq_len)
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    report = {"settings": asdict(training), "seconds": seconds, "train_tokens": len(trained_on),
              "final_loss": sum(losses[-10:]) / len(losses[-10:]), "first_loss": losses[0],
              "held_out_loss": loss, "held_out_entropy": entropy}
    (target / "training.json").write_text(json.dumps(report, indent=2))


def materialise(training: Training = Training()) -> Path:
    """The trained model's directory, trained on first use (minutes). Safe when several processes race."""
    return default_model.built_once(default_model.cache_root() / f"trained-{training.fingerprint()}",
                                    lambda staging: build(staging, training))


def report(path: Path) -> dict:
    """What `build` measured when it trained the model in `path`."""
    return json.loads((path / "training.json").read_text())
