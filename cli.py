"""``fo-tune``: overlap of a tensor-parallel GEMM with its collective, tuned for the machine it runs on.

This module only wires the command modules of ``fo_tune.cli``; each calls a library function.
"""

from importlib import metadata
from typing import Annotated

import typer

from fo_tune.cli import bench, calibrate, demo, model, profile, search, table
from fo_tune.cli.errors import OneLineErrorsGroup

HELP = "\n\n".join(
    [
        "Overlap a tensor-parallel GEMM with its collective (GEMM + AllReduce, GEMM + ReduceScatter, "
        "AllGather + GEMM) with the engine that wins on this machine: triton (FlashOverlap's "
        "signalled GEMM and NCCL per group) or copy_engine (GEMM chunks, copy-engine pulls between "
        "NVLink peers), or neither (overlap: false).",
        "The flow: calibrate the machine -> model each engine's time under contention -> search "
        "schedules over every engine that can run here -> write schedule tables -> the runtime "
        "(fo_kernels.gemm_all_reduce / gemm_reduce_scatter / all_gather_gemm) looks them up.",
        "Commands: calibrate (bandwidth curves, interference table and GEMM tile profiles of this "
        "machine), profile (every tile config of the search space for one shape, next to cuBLAS), "
        "search (tune schedules: measured, predicted offline from a calibration, or both; writes the "
        "tables), table (list, show, look up, validate, diff tables; pull a fleet's tables from the "
        "study storage its workers share), model (check the cost model against measured rows and "
        "trials, fit its free parameters), bench (fo-tune next to every alternative, side by side) "
        "and demo (check and time the runtime on local ranks).",
        "--version prints fo-tune's version.",
    ]
)

# The distribution whose version --version prints (pyproject.toml's name).
DISTRIBUTION = "fo-tune"

app = typer.Typer(
    name="fo-tune",
    help=HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=OneLineErrorsGroup,  # a usage error is one line on stderr, exit 2
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fo-tune {metadata.version(DISTRIBUTION)}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print fo-tune's version and exit."),
    ] = False,
) -> None:
    """The root options (the commands are added below)."""


calibrate.register(app)
profile.register(app)
search.register(app)
demo.register(app)
table.register(app)
model.register(app)
bench.register(app)


def main() -> None:
    """The ``fo-tune`` console script."""
    app()


if __name__ == "__main__":
    main()
