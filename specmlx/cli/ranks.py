"""Starting a command as ranks (mlx.launch): the split checked first, the options passed on,
the API key sent on stdin."""

from __future__ import annotations

import sys

import typer

from ..errors import BadInput
from .common import resolve_models


def check_split(hosts, hostfile, target) -> None:
    """Before any rank starts: the hosts are well formed and the target can be split over
    them (both one-line errors)."""
    from ..distributed.launch import parse_hosts
    from ..models.inspection import peek
    from ..models.registry import load_registry
    from ..models.sharding import check_shardable, shard_support

    names = parse_hosts(hosts, hostfile)
    registry = load_registry()
    spec = registry.resolve(resolve_models(registry, target, None, False, None).target)
    config, _ = peek(spec)
    check_shardable(config, len(names), spec.alias, shard_support(config))


def launch_command(
    ctx: typer.Context, command: str, hosts, hostfile, tail: list[str] = (), secret=None
) -> int:
    """Start this same command as ranks with mlx.launch; returns the exit code. ``secret``
    (the server's API key) goes to the ranks on stdin, never on a command line."""
    from ..distributed.launch import launch

    skip = {"hosts", "hostfile", "prompt", "suffix_file", "api_key"}
    skip |= {"seed"} if command == "run" else set()
    return launch([command, *option_argv(ctx, skip), *tail], hosts, hostfile, secret=secret)


def read_secret(timeout: float = 60.0) -> str:
    """The first line of stdin (a rank's API key, sent by `launch`), waited for at most
    ``timeout`` seconds."""
    import select

    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    line = sys.stdin.readline().strip() if ready else ""
    if not line:
        raise BadInput("the API key did not arrive on this rank's stdin")
    return line


def option_argv(ctx: typer.Context, skip: set[str]) -> list[str]:
    """This command's options as given, back as arguments (for the ranks to run it too)."""
    out: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if (
            param.name in skip
            or not getattr(param, "opts", None)
            or param.param_type_name != "option"
        ):
            continue
        if value is None or value == param.default or (param.multiple and not value):
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            out.append(flag)
        elif param.multiple:
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out
