"""``fo-tune table lookup``: the row the runtime would use for one call (library:
``fo_tune.tables.find.find_row``; for an MoE call, ``--experts`` and ``--tokens``,
``find_moe_row``), with what a miss adds.

A lookup on a machine whose device key has no table (a CPU-only machine planning a GPU
deployment) names the device keys that have tables and the ``-k`` that picks one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fo_tune.cli.common import COLLECTIVE_NAMES, DTYPE_NAMES, SHARDED_COLLECTIVE_NAMES, json_text
from fo_tune.cli.errors import handle_errors
from fo_tune.cli.search_moe import MOE_COLLECTIVE
from fo_tune.cli.table_options import (
    DEFAULT_COLLECTIVE,
    DEFAULT_DTYPE,
    DEFAULT_WORLD_SIZE,
    CollectiveOpt,
    DeviceKeyOpt,
    TableDtypeOpt,
    check_choice,
    gc_paused,
    world_of,
)
from fo_tune.cli.table_rows import kind_label

LOOKUP_HELP = "\n\n".join(
    [
        "Print the row the runtime (fo_kernels.lookup_schedule) would use for one call, as YAML "
        "(--json: as JSON): device_key, source (the table file it comes from), kind (measured or "
        "predicted) and the row with its provenance.",
        "The runtime reads every table for the device key, collective, world size and dtype in its "
        "search path ($FO_TUNE_TABLE_DIR, the user folder, the packaged tables) and takes a "
        "measured exact-shape row, else a measured M-range row covering M, else a predicted "
        "exact-shape row, else a predicted M-range row; between rows of the same kind the folder "
        "order decides. Without a matching row it runs overlap: false (GEMM then the collective); "
        "lookup then prints that with source: no table row and the files it read.",
        "--device-key (-k) defaults to this machine's key for --world-size. A table belongs to the "
        "machine it was tuned for: on a machine without that GPU (a CPU-only one planning an H200 "
        "deployment) pass its key, e.g. -k nvidia-h200-cc90-132sm-w2-nvlink18; the world size then "
        "defaults to the key's (its -w<N>-), and a --world-size the key contradicts is exit 2. When "
        "the key (this machine's or -k's) has no table, the answer names the keys that have one "
        "(hint, other_device_keys). `fo-tune table list` lists them all.",
        "An MoE call (expert_parallel_ffn with schedule=None): --experts H,I,E_LOCAL,K and --tokens "
        "T, the most tokens any rank of the call holds (the runtime looks its row up by that, so "
        "every rank takes the same row), with --world-size, --dtype and -k as above. The runtime "
        "reads moe-w<world>-<dtype>.yaml in every folder and takes the measured row whose bucket "
        "holds T, else the predicted one, the folder order deciding between rows of one kind; "
        "without one it runs the no-overlap path (dispatch, grouped GEMMs, combine), which lookup "
        "prints with source: no table row and the files it read.",
        "Exit code 0 when printed (a row or overlap: false), 2 for bad options, a malformed table or "
        "one the runtime refuses (another call's header under this call's name, another GPU's "
        "fingerprint in this device key's folder): the message names the file and what to do.",
    ]
)


ShapeOpt = Annotated[
    str | None,
    typer.Option(
        "--shape",
        "-s",
        metavar="MxNxK",
        help="The call's GEMM: M x N x K per rank (all_gather: M is the gathered M, w x a shard's rows).",
        show_default=False,
    ),
]
LookupWorldSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--world-size",
        "-w",
        help="World size of the call. Default: the one in --device-key's key (its -w<N>-), else "
        f"{DEFAULT_WORLD_SIZE}.",
        show_default=False,
    ),
]
ExpertsOpt = Annotated[
    str | None,
    typer.Option(
        "--experts",
        metavar="H,I,E_LOCAL,K",
        help="An MoE call's experts' shape: hidden, intermediate, local experts per rank, top_k "
        "(with --tokens; instead of --shape).",
        show_default=False,
    ),
]
TokensOpt = Annotated[
    str | None,
    typer.Option(
        "--tokens",
        "-t",
        metavar="T",
        help="An MoE call's tokens per rank: one integer >= 0, the most any rank of the call holds "
        "(with --experts).",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML.")]


def _miss_hint(device_key: str, read: list[Path], given: bool) -> dict[str, Any]:
    """What a miss adds when ``device_key`` (this machine's, or the one -k ``given``) has no table
    for the call: where the key holds tables of other collectives or dtypes, their names; where it
    holds none, the keys that have one, those of ``device_key``'s world size first, and how to pick
    one (its -w too where no key of the call's world size has one). Empty when a table of the call
    was read (the miss is its rows') or no key has a table."""
    from fo_kernels.fingerprint import read_device_key
    from fo_tune.tables.find import held_tables, known_device_keys

    def world(key: str) -> int | None:
        fields = read_device_key(key)
        return None if fields is None else int(fields["world_size"])

    if read:
        return {}
    known = known_device_keys()
    whose = "the device key" if given else "this machine's device key"
    if device_key in known:
        return {
            "hint": f"no table of this call for {whose} {device_key}; it holds "
            f"{', '.join(held_tables(device_key))}: pick the collective and dtype with -c and -d"
        }
    mine = world(device_key)
    others = sorted((key for key in known if key != device_key), key=lambda key: world(key) != mine)
    if not others:
        return {}
    example = others[0]  # (one of the call's world size where one has tables)
    theirs = world(example)
    pick = f"-k {example}" if theirs == mine or theirs is None else f"-k {example} -w {theirs}"
    none_here = "" if theirs == mine else f" (none of world size {mine})"
    return {
        "hint": f"no table for {whose} {device_key}; tables exist for "
        f"{', '.join(others)}{none_here}: pick one with -k KEY (--device-key), e.g. {pick}",
        "other_device_keys": others,
    }


@handle_errors
@gc_paused
def lookup(
    shape: ShapeOpt = None,
    collective: CollectiveOpt = None,
    world_size: LookupWorldSizeOpt = None,
    dtype: TableDtypeOpt = None,
    device_key: DeviceKeyOpt = None,
    json_out: JsonOpt = False,
    experts: ExpertsOpt = None,
    tokens: TokensOpt = None,
) -> None:
    """``fo-tune table lookup`` (its help: ``LOOKUP_HELP``)."""
    from fo_tune.cli.common import parse_shape

    if world_size is not None and world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1, got {world_size}")
    if experts is not None or tokens is not None or collective == MOE_COLLECTIVE:
        # (the collective first: -c all_reduce -s MxNxK --tokens T is a dense call with a stray option)
        if collective not in (None, MOE_COLLECTIVE):
            given = [o for o, v in (("--experts", experts), ("--tokens", tokens)) if v is not None]
            verb = "looks" if len(given) == 1 else "look"
            raise typer.BadParameter(
                f"{' and '.join(given)} {verb} an MoE call up (-c moe), not -c {collective}; a dense call "
                "is --shape MxNxK alone"
            )
        if shape is not None:
            raise typer.BadParameter("--shape is a dense call's; an MoE call is --experts and --tokens")
        out = _moe_lookup(experts, tokens, world_size, dtype, device_key)
        _print_answer(out, json_out)
        return
    if shape is None:
        raise typer.BadParameter("--shape MxNxK: the call to look up is missing")
    m, n, k = parse_shape(shape)
    collective = check_choice(
        "--collective", DEFAULT_COLLECTIVE if collective is None else collective, COLLECTIVE_NAMES
    )
    dtype = check_choice("--dtype", DEFAULT_DTYPE if dtype is None else dtype, DTYPE_NAMES)
    from fo_tune.ranks.limits import Target, check_problem_size

    # a size above int32 or an fp8 N, K the ops refuse: no call of that shape runs, so no row answers
    check_problem_size([(m, n, k)], dtype, Target(None, "the call"))
    world = world_of(world_size, device_key)
    if collective in SHARDED_COLLECTIVE_NAMES and m % world:
        gathered = " (all_gather's M is the gathered M)" if collective == "all_gather" else ""
        raise typer.BadParameter(
            f"--shape {shape}: {collective} needs M divisible by the world size {world}{gathered}"
        )
    from fo_kernels.table import MISS_SOURCE
    from fo_tune.tables.find import find_row

    given = device_key is not None
    if device_key is None:
        from fo_kernels.fingerprint import current_fingerprint

        device_key = current_fingerprint(None, world).device_key
    row, path, read = find_row(device_key, collective, world, dtype, m, n, k)
    out: dict[str, Any] = {"device_key": device_key}
    if row is None:
        out.update(
            source=f"{MISS_SOURCE}: the runtime runs overlap: false (GEMM then the collective)",
            searched=[str(p) for p in read],
            row={"problem": {"m": m, "n": n, "k": k}, "overlap": False},
        )
        out.update(_miss_hint(device_key, read, given))
    else:
        data = row.to_dict()
        for key in ("collective", "dtype", "world_size"):
            data.pop(key)
        out.update(source=str(path), kind=kind_label(row), row=data)
    _print_answer(out, json_out)


def _print_answer(out: dict[str, Any], json_out: bool) -> None:
    import yaml

    if json_out:
        typer.echo(json_text(out))
    else:
        typer.echo(yaml.safe_dump(out, sort_keys=False, width=110), nl=False)


def _parse_call_tokens(text: str) -> int:
    """``--tokens T`` of one MoE call: an integer >= 0, else ``typer.BadParameter`` saying what to
    give (a list, what ``fo-tune search -c moe --tokens`` takes, names the search's option)."""
    try:
        tokens = int(text.strip())
    except ValueError:
        raise typer.BadParameter(
            f"--tokens {text!r}: expected one integer >= 0, the most tokens any rank of the call holds "
            "(a lookup answers one call; `fo-tune search -c moe --tokens T,...` takes a list of buckets)"
        ) from None
    if tokens < 0:
        raise typer.BadParameter(f"--tokens must be >= 0, got {tokens}")
    return tokens


def _moe_lookup(
    experts: str | None, text: str | None, world_size: int | None, dtype: str | None, device_key: str | None
) -> dict[str, Any]:
    """The answer of an MoE lookup: the row ``expert_parallel_ffn`` takes for the call (with its
    file and kind), or the no-overlap path and the files read."""
    if experts is None or text is None:
        missing = "--experts H,I,E_LOCAL,K" if experts is None else "--tokens T"
        raise typer.BadParameter(f"{missing}: an MoE lookup needs the experts' shape and the tokens per rank")
    tokens = _parse_call_tokens(text)
    from fo_tune.moe.plan import ExpertsShape, check_moe_dtype, check_moe_size
    from fo_tune.ranks.limits import Target

    shape = ExpertsShape.parse(experts)
    key = (shape.hidden, shape.intermediate, shape.experts, shape.top_k)
    dtype = check_choice("--dtype", DEFAULT_DTYPE if dtype is None else dtype, DTYPE_NAMES)
    check_moe_dtype(dtype)
    check_moe_size([shape], [tokens], dtype, Target(None, "the call"))  # (int32 sizes, as the search's)
    world = world_of(world_size, device_key)
    named = "--world-size" if world_size is not None else "-k's world size" if device_key else ""
    shape.check_world(world, named or "the default --world-size")
    from fo_kernels.table import MISS_SOURCE
    from fo_tune.tables.find import find_moe_row

    given = device_key is not None
    if device_key is None:
        from fo_kernels.fingerprint import current_fingerprint

        device_key = current_fingerprint(None, world).device_key
    row, path, read = find_moe_row(device_key, world, dtype, key, tokens)
    out: dict[str, Any] = {"device_key": device_key}
    if row is None:
        problem = dict(zip(("hidden", "intermediate", "experts", "top_k"), key, strict=True))
        out.update(
            source=f"{MISS_SOURCE}: the runtime runs the no-overlap path (dispatch, grouped GEMMs, combine)",
            searched=[str(p) for p in read],
            row={"problem": {**problem, "tokens": tokens}, "engine": None},
        )
        out.update(_miss_hint(device_key, read, given))
        return out
    out.update(source=str(path), kind=row.kind, row=row.to_dict())
    return out
