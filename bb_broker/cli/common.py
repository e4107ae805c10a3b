"""The `bb-broker` commands' classes: each refuses, in one line and before it runs, a text argument that is not
UTF-8 (what the database and every message store), wherever it comes from: an argument, an option, a variable."""

from __future__ import annotations

from typing import Any

import click

#: The exit status of a command refused for its arguments (click's own for a usage error).
BAD_ARGUMENT = 2


def _not_utf8(value: Any) -> str | None:
    """Where a text of `value` (a parameter's: a text, or a tuple of them) is not UTF-8, in words; None when none is.

    Python reads each argument and variable as UTF-8, turning the bytes that are not into lone surrogates
    (surrogateescape); such a text cannot be stored (BSON), sent (JSON) or printed as UTF-8. The value itself is
    not shown: it may be a URL or a password."""
    texts = value if isinstance(value, tuple | list) else (value,)
    for number, text in enumerate(texts, 1):
        if not isinstance(text, str) or text.isascii():
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = text[exc.start]
            byte = f"byte {ord(bad) - 0xDC00:#04x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character {ascii(bad)}"
            which = f" (the value number {number})" if len(texts) > 1 else ""
            return f"{which} is not UTF-8 text: {byte} at character {exc.start + 1}"
    return None


def _refuse_text_not_utf8(ctx: click.Context) -> None:
    for param in ctx.command.params:
        if isinstance(param.type, click.Path):
            continue  # a file's name is bytes: any the system takes will do
        problem = _not_utf8(ctx.params.get(param.name or ""))
        if problem is not None:
            name = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name.strip("[].")
            names = []
            while ctx.parent is not None:
                names.append(ctx.info_name or "")
                ctx = ctx.parent
            command = " ".join(reversed(names)) or "bb-broker"
            click.echo(f"bb-broker: {command}: {name}{problem} (names, ids and URLs must be)", err=True)
            ctx.exit(BAD_ARGUMENT)


class Command(click.Command):
    """A command that refuses a text parameter that is not UTF-8 (see _not_utf8) before it runs."""

    def invoke(self, ctx: click.Context) -> Any:
        _refuse_text_not_utf8(ctx)
        return super().invoke(ctx)


class Group(click.Group):
    """A group whose own parameters, and its commands' (made with `@group.command()`/`@group.group()`), refuse a
    text that is not UTF-8."""

    command_class = Command
    group_class = type  # a subgroup is a Group too

    def invoke(self, ctx: click.Context) -> Any:
        _refuse_text_not_utf8(ctx)
        return super().invoke(ctx)
