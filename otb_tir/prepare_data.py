"""``otb-tir-prepare-data`` (or ``python recipes/prepare_data.py``): turn local math datasets into
verl-format parquet files (nothing is downloaded).

    otb-tir-prepare-data --gsm8k gsm8k.jsonl --test-frac 0.1 --out data/    # train and test in one call
    otb-tir-prepare-data --gsm8k data/gsm8k/test.jsonl --split test --out data/
    otb-tir-prepare-data --math data/MATH/test --split test --out data/
    otb-tir-prepare-data --builtin 2000 --builtin-test 200 --out data/

* GSM8K: a jsonl file with ``question`` and ``answer`` (the answer ends with ``#### 42``).
* MATH: a jsonl/json file, or a directory searched recursively for ``*.json``/``*.jsonl``, with
  ``problem`` and ``solution`` (the final answer is the last ``\\boxed{...}`` in the solution).
* ``--test-frac F``: each input is split into ``<name>_train`` and ``<name>_test`` (a fraction F of
  its records, drawn with ``--seed``), the two files a run takes as ``data.train_files`` and
  ``data.val_files``.
* ``--builtin N``: the built-in generator's train split (N problems) and held-out split
  (``--builtin-test``, default N // 5), see ``agent_env.math_task.data``.

Each output row has verl's columns: ``data_source``, ``prompt`` (one user message),
``reward_model`` (``{"style": "rule", "ground_truth": ...}``), ``extra_info`` and ``agent_name``.
Files written: ``gsm8k_<split>.parquet``, ``math_<split>.parquet``, ``arith_train.parquet``,
``arith_test.parquet`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Iterator

from agent_env import EnvError
from agent_env.math_task.data import AGENT_NAME, INSTRUCTION, make_split, write_parquet
from otb_tir import ConfigError

logger = logging.getLogger("prepare_data")

GSM8K_SOURCE = "openai/gsm8k"  # names verl's default reward dispatches on
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"


def _read_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` from a .jsonl file, a .json file (object or list of objects) or a
    directory holding such files (recursively, in sorted order)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
        if not files:
            raise ConfigError(f"{path} holds no .json or .jsonl files")
        for file in files:
            yield from _read_records(file)
        return
    if not path.is_file():
        raise ConfigError(f"input not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            yield f"{path}:{lineno}", record
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg}); use .jsonl for one record per line") from exc
    records = data if isinstance(data, list) else [data]
    for i, record in enumerate(records):
        yield f"{path}[{i}]", record


def _field(record: Any, name: str, where: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(name), str):
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where}: expected a string field {name!r}; the record has {have}")
    return record[name]


def gsm8k_answer(solution: str, where: str = "answer") -> str:
    """The final answer of a GSM8K solution: the text after ``####``, without thousands commas."""
    if "####" not in solution:
        raise ConfigError(f"{where}: GSM8K answer has no '#### <number>' line: {solution[-80:]!r}")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise ConfigError(f"{where}: empty answer after '####'")
    return answer


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    best = None
    for macro in ("\\boxed", "\\fbox"):
        start = text.rfind(macro + "{")
        if start >= 0 and (best is None or start > best[0]):
            best = (start, start + len(macro) + 1)
    if best is None:
        return None
    depth, i = 1, best[1]
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[best[1] : i].strip()
        i += 1
    return None  # unbalanced


def _item(
    source: str, question: str, truth: str, split: str, index: int, extra: dict[str, Any], instruction: str
) -> dict[str, Any]:
    content = f"{question.strip()} {instruction}".strip()
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": question, **extra},
        "agent_name": AGENT_NAME,
    }


def convert_gsm8k(
    path: str | Path, split: str, limit: int | None = None, instruction: str = INSTRUCTION
) -> list[dict[str, Any]]:
    """GSM8K jsonl → verl-format dicts."""
    items = []
    for where, record in _read_records(Path(path)):
        if limit is not None and len(items) >= limit:
            break
        question = _field(record, "question", where)
        solution = _field(record, "answer", where)
        truth = gsm8k_answer(solution, where)
        items.append(_item(GSM8K_SOURCE, question, truth, split, len(items), {"answer": solution}, instruction))
    if not items:
        raise ConfigError(f"{path}: no GSM8K records found")
    return items


def convert_math(
    path: str | Path, split: str, limit: int | None = None, instruction: str = INSTRUCTION
) -> list[dict[str, Any]]:
    """MATH json/jsonl file or directory → verl-format dicts (records without a \\boxed answer are
    skipped with a warning)."""
    items, skipped = [], 0
    for where, record in _read_records(Path(path)):
        if limit is not None and len(items) >= limit:
            break
        problem = _field(record, "problem", where)
        solution = _field(record, "solution", where)
        truth = last_boxed(solution)
        if not truth:
            skipped += 1
            logger.warning("%s: no \\boxed{} answer in the solution; skipped", where)
            continue
        extra = {"solution": solution, "level": str(record.get("level", "")), "type": str(record.get("type", ""))}
        items.append(_item(MATH_SOURCE, problem, truth, split, len(items), extra, instruction))
    if not items:
        raise ConfigError(f"{path}: no MATH records with a \\boxed{{}} answer found ({skipped} skipped)")
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="otb-tir-prepare-data",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gsm8k", type=Path, help="GSM8K jsonl file (question / answer '#### N')")
    parser.add_argument("--math", type=Path, help="MATH json/jsonl file or directory (problem / solution)")
    parser.add_argument("--split", default="train", help="split name for --gsm8k/--math (default: train)")
    parser.add_argument(
        "--test-frac",
        type=float,
        metavar="F",
        help="split each --gsm8k/--math input into <name>_train and <name>_test (a fraction F, drawn with --seed)",
    )
    parser.add_argument(
        "--builtin",
        type=int,
        metavar="N",
        help="write N built-in generator problems (train) and --builtin-test held-out ones",
    )
    parser.add_argument("--builtin-test", type=int, metavar="M", help="held-out size (default: N // 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the built-in generator")
    parser.add_argument("--limit", type=int, help="keep at most this many records per input")
    parser.add_argument("--instruction", default=INSTRUCTION, help="text appended to every question")
    parser.add_argument("--out", type=Path, default=Path("data"), help="output folder (default: ./data)")
    return parser


def split_off(items: list[dict[str, Any]], frac: float, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, test)``: a fraction ``frac`` of ``items`` drawn with ``seed`` (at least one each), in
    their original order, each row's ``extra_info.split`` and ``index`` set to its new split."""
    import random

    n_test = round(len(items) * frac)
    if not 0 < n_test < len(items):
        raise ConfigError(
            f"--test-frac {frac} of {len(items)} records leaves {n_test} for test and {len(items) - n_test} for train: "
            "both must be at least 1"
        )
    chosen = set(random.Random(seed).sample(range(len(items)), n_test))
    parts: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for i, item in enumerate(items):
        split = "test" if i in chosen else "train"
        extra = {**item["extra_info"], "split": split, "index": len(parts[split]), "source_index": i}
        parts[split].append({**item, "extra_info": extra})
    return parts["train"], parts["test"]


def main(argv: list[str] | None = None) -> list[Path]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.test_frac is not None and not 0 < args.test_frac < 1:
        parser.error(f"--test-frac must be between 0 and 1, got {args.test_frac}")
    if args.gsm8k is None and args.math is None and args.builtin is None:
        parser.error("nothing to do: give --gsm8k, --math and/or --builtin")
    if args.builtin is not None and args.builtin <= 0:
        parser.error(f"--builtin must be positive, got {args.builtin}")
    if args.limit is not None and args.limit <= 0:
        parser.error(f"--limit must be positive, got {args.limit}")
    written: list[Path] = []
    try:
        jobs = []
        inputs = []
        if args.gsm8k is not None:
            inputs.append(("gsm8k", convert_gsm8k(args.gsm8k, args.split, args.limit, args.instruction)))
        if args.math is not None:
            inputs.append(("math", convert_math(args.math, args.split, args.limit, args.instruction)))
        for name, items in inputs:
            if args.test_frac is None:
                jobs.append((f"{name}_{args.split}", items))
            else:
                train, test = split_off(items, args.test_frac, args.seed)
                jobs += [(f"{name}_train", train), (f"{name}_test", test)]
        if args.builtin is not None:
            n_test = args.builtin_test if args.builtin_test is not None else max(1, args.builtin // 5)
            jobs.append(("arith_train", make_split("train", args.builtin, args.seed)))
            jobs.append(("arith_test", make_split("test", n_test, args.seed)))
        for name, items in jobs:
            path = write_parquet(items, args.out / f"{name}.parquet")
            logger.info("wrote %d rows to %s", len(items), path)
            written.append(path)
    except (ConfigError, EnvError) as exc:
        parser.exit(2, f"otb-tir-prepare-data: error: {exc}\n")
    return written


def cli(argv: list[str] | None = None) -> int:
    """The console script: INFO lines to stdout, exit 0 (errors exit 2 from :func:`main`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
