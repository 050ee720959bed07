"""Expert parallelism for MoE layers: the SwiGLU experts' grouped GEMMs with their All-to-All
dispatch and combine, overlapped.

    routing.py    checks of one rank's call; rows sorted by expert, per-expert counts
    exchange.py   the counts exchange (the first collectives), byte rows, All-to-All and ring steps
    grouped.py    the experts' GEMMs in torch (torch._grouped_mm or a loop), SwiGLU and its gradient
    stages.py     what each direction computes: outgoing rows, phase 1 and 2 per slot, the finish
    fallback.py   no overlap: dispatch -> grouped GEMMs -> combine
    schedule.py   MoeSchedule, MoeProblem
    table.py      the MoE schedule table (keyed by the experts' shape and tokens per rank), its
                  file and the runtime's lookup of a call's row
    call.py       execute_ffn: checks, routing, counts, then the path
    ops.py        the custom ops, fake implementations, autograd
    ffn.py        expert_parallel_ffn, the public op

Importing the package defines no kernel and registers no op; ``fo_kernels.expert_parallel_ffn``
loads ``ffn.py`` on first use.
"""
