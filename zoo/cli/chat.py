"""`zoo chat SOURCE`: a conversation with a trained model in the terminal (litgpt's `chat` shape).

Each line you type is a user turn; the answer streams back. The conversation is kept and laid out for the
model as `zoo serve` lays it out (`Pipeline.conversation_batch`: the chat format of `zoo.datamodules.chat`
when the model has role tokens, else the plain layout). Commands:

    /image PATH [text]   send an image (to caption, or with a prompt); a model without role tokens reads one
                         image or audio a conversation
    /audio PATH [text]   send speech (to transcribe)
    /reset               forget the conversation
    /help                these commands
    /quit                leave (so does end of input, Ctrl-D)

A line that cannot be answered (a missing file, a conversation past the model's context) says why on
stderr and leaves the conversation as it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from zoo.command_line import command_parser

COMMANDS = """commands: /image PATH [text], /audio PATH [text], /reset, /help, /quit"""


def parser() -> argparse.ArgumentParser:
    p = command_parser("zoo chat", "a conversation with a trained model")
    p.add_argument("source", help="a Lightning checkpoint, a folder `zoo export` wrote, or a hub repo id")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="makes the answers repeatable")
    p.add_argument("--device", default="cpu")
    return p


class Conversation:
    """The turns so far, and one answer at a time through a pipeline."""

    def __init__(self, pipe, sampling: dict[str, object], max_new_tokens: int) -> None:  # noqa: ANN001
        self.pipe, self.sampling, self.max_new_tokens = pipe, sampling, max_new_tokens
        self.turns: list = []

    def reset(self) -> None:
        self.turns = []

    def answer(self, text: str, media_kind: str | None, path: str | None, out: TextIO) -> None:
        """Stream the answer to `text` (with a medium from `path`) to `out`; the turn and its answer join
        the conversation only when the answer is complete."""
        from zoo.datamodules.chat import Turn

        parts: list = [text] if text else []
        if media_kind is not None and path is not None:
            file = Path(path).expanduser()
            if not file.is_file():
                raise ValueError(f"{path}: no such file")
            parts.append(self.pipe.read_media(media_kind, file, name=path))
        turn = Turn("user", tuple(parts), f"line {len(self.turns) // 2 + 1}")
        pieces = self.pipe.chat([*self.turns, turn], max_new_tokens=self.max_new_tokens, **self.sampling)
        answer = []
        for piece in pieces:
            answer.append(piece)
            out.write(piece)
            out.flush()
        out.write("\n")
        self.turns += [turn, Turn("assistant", ("".join(answer),))]


def run(conversation: Conversation, lines: TextIO, out: TextIO, err: TextIO, prompt: str) -> None:
    """Read `lines` until /quit or their end, answering each (module docstring)."""
    while True:
        if prompt:
            out.write(prompt)
            out.flush()
        line = lines.readline()
        if not line:
            return
        line = line.strip()
        if not line:
            continue
        command, _, rest = line.partition(" ")
        if command in ("/quit", "/exit"):
            return
        if command == "/help":
            out.write(COMMANDS + "\n")
            continue
        if command == "/reset":
            conversation.reset()
            out.write("(conversation forgotten)\n")
            continue
        media_kind, path, text = None, None, line
        if command in ("/image", "/audio"):
            path, _, text = rest.strip().partition(" ")
            if not path:
                err.write(f"{command} needs a file: {command} PATH [text]\n")
                continue
            media_kind = command[1:]
        elif command.startswith("/"):
            err.write(f"unknown command {command}; {COMMANDS}\n")
            continue
        try:
            conversation.answer(text.strip(), media_kind, path, out)
        except ValueError as error:  # MediaError, ChatError and the pipeline's refusals are ValueErrors
            hint = " (/reset starts afresh)" if "context" in str(error) else ""
            err.write(f"error: {error}{hint}\n")


def chat_main(argv: list[str]) -> None:
    from zoo.inference import pipeline

    args = parser().parse_args(argv)
    pipe = pipeline(args.source, device=args.device)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"zoo chat with {args.source}; {COMMANDS}")
    run(Conversation(pipe, sampling, args.max_new_tokens), sys.stdin, sys.stdout, sys.stderr,
        "> " if interactive else "")  # fmt: skip
