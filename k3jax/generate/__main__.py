"""Generate text from a training run's newest checkpoint.

    python -m k3jax.generate --workdir runs/tiny --prompt "def main(" --max-new-tokens 64
    python -m k3jax.generate --workdir runs/tiny --prompts-file prompts.txt --temperature 0

The run's ``config.json`` gives the model and the corpus it trained on (``data.corpus``), whose
saved tokenizer is used (``--tokenizer DIR`` names another directory holding a ``tokenizer.json``).
One prompt streams its text as it is generated; a file holds one prompt per line, generated as one
batch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3jax.config.base import ConfigError

REPLACEMENT = "\ufffd"  # what a decode puts for bytes that are not (yet) a whole character


def run_tokenizer(config: dict, workdir: Path, override: str | None):
    """The tokenizer saved with the corpus the run trained on (``data.corpus`` of its recorded
    ``config``), or the one in ``override``; checked against the run's data and model.

    Never builds anything: a corpus rebuilt from the config could hold a newly trained BPE.
    """
    from k3jax.data import load_tokenizer

    data, vocab = config["data"], config["model"]["vocab_size"]
    task = data["task"]
    if override is not None:
        tok = load_tokenizer(Path(override))
        if task == "corpus" and tok.kind != data["tokenizer"]:
            raise ConfigError(f"tokenizer mismatch: the run trained with data.tokenizer="
                              f"{data['tokenizer']!r}, the tokenizer found is {tok.kind!r}")
    elif task != "corpus":
        raise FileNotFoundError(f"{workdir}: the run trained on the synthetic task {task!r}, "
                                "which has no tokenizer; pass --tokenizer")
    else:
        corpus = data.get("corpus")
        if not corpus:
            raise FileNotFoundError(f"{workdir / 'config.json'}: no data.corpus (the corpus the "
                                    "run trained on); pass --tokenizer DIR, the directory of that "
                                    "corpus")
        try:
            tok = load_tokenizer(Path(corpus["corpus"]))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"data.corpus of {workdir / 'config.json'}: {e}; pass "
                                    "--tokenizer DIR for a copy of it") from None
        if (tok.kind, tok.vocab_size) != (corpus["kind"], corpus["vocab_size"]):
            raise ConfigError(f"tokenizer mismatch: the run recorded a {corpus['kind']} tokenizer "
                              f"of {corpus['vocab_size']} ids in {corpus['corpus']}, which now "
                              f"holds a {tok.kind} tokenizer of {tok.vocab_size}")
    if tok.vocab_size > vocab:
        raise ConfigError(f"tokenizer mismatch: {tok.vocab_size} token ids, the model has "
                          f"vocab_size={vocab}")
    return tok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k3jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-len", type=int, default=None,
                   help="cache length in tokens (default: longest prompt + max-new-tokens - 1, "
                        "the last new token is never fed back)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[],
                   help="stop at this text (one token); repeatable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="directory with a tokenizer.json")
    return p


def _check_flags(args: argparse.Namespace) -> None:
    """The numeric flags against what they allow (the sampling ones by SamplingConfig's rules),
    before any file is read: a ConfigError naming the flag."""
    from k3jax.generate.sampling import RULES

    rules = {**RULES, "max_new_tokens": (lambda v: v >= 1, "expected >= 1"),
             "max_len": (lambda v: v is None or v >= 1, "expected >= 1")}
    for name, (allowed, expected) in rules.items():
        value = getattr(args, name)
        if not allowed(value):
            raise ConfigError(f"--{name.replace('_', '-')}={value!r} is invalid: {expected}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_flags(args)
        return _generate(args)
    except (FileNotFoundError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from k3jax.evaluate import recorded_config, restore_workdir
    from k3jax.generate.loop import cache_length, generate
    from k3jax.generate.sampling import SamplingConfig

    workdir = Path(args.workdir)
    if args.prompts_file is not None:
        prompts = [line for line in Path(args.prompts_file).read_text().splitlines() if line]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file}: no prompt in it")
    else:
        prompts = [args.prompt]
    tok = run_tokenizer(recorded_config(workdir), workdir, args.tokenizer)
    stops = []
    for text in args.stop:
        ids = tok.encode(text.encode())
        if len(ids) != 1:
            raise ValueError(f"--stop {text!r}: encodes to {len(ids)} tokens; expected one")
        stops.append(int(ids[0]))
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.repetition_penalty,
                              tuple(stops), args.seed)
    encoded = [[int(t) for t in tok.encode(p.encode())] for p in prompts]
    if any(not e for e in encoded):
        raise ValueError("a prompt encodes to no token")
    max_len = cache_length(max(map(len, encoded)), args.max_new_tokens, args.max_len, "--max-len")
    cfg, state, meta = restore_workdir(workdir, log=lambda m: print(m, file=sys.stderr))
    variables = {"params": state["params"], "balance": state["balance"]}
    print(f"[generate] checkpoint step {int(meta['step'])} of {workdir}", file=sys.stderr)
    stream = _Stream(tok) if len(prompts) == 1 else None
    if stream is not None:
        print(prompts[0], end="", flush=True)
    out = generate(cfg.model, variables, encoded, args.max_new_tokens, sampling,
                   max_len=max_len, on_tokens=None if stream is None else stream)
    if stream is None:
        for prompt, new in zip(prompts, out):
            print(prompt + tok.decode(new).decode("utf-8", errors="replace"))
    else:
        stream.finish()
        print(flush=True)
    return 0


class _Stream:
    """Prints one row's text as tokens arrive.

    Tokens decode to bytes, so the text of a row is the concatenation of its pieces' texts as long
    as each piece ends on a whole character. Both tokenizers' decodes end a UTF-8 sequence whose
    bytes are still arriving with one U+FFFD: such a piece's tokens are held back until a later
    token completes the character, or :meth:`finish` shows them. The printed text is then exactly
    the decode of the whole row, as a batch prints it, each token decoded once or a few times.
    """

    def __init__(self, tok):
        self.tok, self.pending = tok, []

    def __call__(self, tokens, active) -> None:
        if not active[0]:
            return
        self.pending.append(int(tokens[0]))
        text = self._text()
        if not text.endswith(REPLACEMENT):
            self._show(text)

    def finish(self) -> None:
        self._show(self._text())

    def _text(self) -> str:
        return self.tok.decode(self.pending).decode("utf-8", errors="replace")

    def _show(self, text: str) -> None:
        print(text, end="", flush=True)
        self.pending = []


if __name__ == "__main__":
    sys.exit(main())
