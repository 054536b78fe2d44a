"""Trains the default model's byte-level BPE tokenizer from `corpus.txt` and writes `tokenizer.json`.

    python -m sidecar.default_model.train_tokenizer

The corpus is this project's own documentation, committed beside this script, so the result is
reproducible from the repository alone. Byte-level BPE can encode any text, whatever the corpus.
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).parent
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def train(corpus: Path = HERE / "corpus.txt") -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    return tokenizer


if __name__ == "__main__":
    train().save(str(HERE / "tokenizer.json"))
    print(f"wrote {HERE / 'tokenizer.json'}")
