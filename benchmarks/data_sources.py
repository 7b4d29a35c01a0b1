"""Reading the same text as local files and as an `hf:` folder through `datasets`: what streaming costs.

One JSONL file of documents (the default corpus's training files, one per line, `--docs` of them) is
encoded with the default tokenizer into a fresh cache, alternately as `--data FILE` (swarmnode's own
reader) and as `--data hf:FOLDER` (`datasets.load_dataset(..., streaming=True)`, the folder holding the
file as `train.jsonl`); the hf source is checked on opening (its first row is read) as a run does. Prints
the median seconds of each over `--repeats` rounds and their ratio (hf / local), and checks that both gave
the same number of tokens.

    .venv/bin/python benchmarks/data_sources.py [--docs 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

from swarmnode.data import load_corpus
from swarmnode.datasource import default_source
from swarmnode.source_spec import DataSource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_corpus().tokenizer_path  # the default one, cached: only encoding is timed
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "set"
        folder.mkdir()
        docs = [doc.text for doc in itertools.islice(default_source().split(validation=False), args.docs)]
        data = folder / "train.jsonl"
        data.write_text("".join(json.dumps({"text": text}) + "\n" for text in docs))
        sources = {"local": DataSource.parse(str(data)), "hf": DataSource.parse(f"hf:{folder}")}
        seconds: dict[str, list[float]] = {name: [] for name in sources}
        tokens: dict[str, int] = {}
        for round_ in range(args.repeats):
            for name, source in sources.items():
                started = time.perf_counter()
                corpus = load_corpus(source, tokenizer, cache=Path(tmp) / f"cache-{name}-{round_}")
                seconds[name].append(time.perf_counter() - started)
                tokens[name] = len(corpus.train_tokens) + len(corpus.val_tokens)
    megabytes = sum(len(text.encode()) for text in docs) / 1e6
    print(f"{args.docs} documents, {megabytes:.1f} MB, {tokens['local']:,} tokens, {args.repeats} rounds")
    print(f"{'source':<8}{'median s':>10}{'MB/s':>8}{'ratio':>8}")
    base = statistics.median(seconds["local"])
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"{name:<8}{median:>10.2f}{megabytes / median:>8.2f}{median / base:>8.2f}")
    if tokens["hf"] != tokens["local"]:
        raise SystemExit(f"the sources gave {tokens['hf']} and {tokens['local']} tokens")


if __name__ == "__main__":
    main()
