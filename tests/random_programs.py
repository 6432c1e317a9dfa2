"""Random small programs with functional collectives, traced with make_fx: graphs for property
tests and the fuzz script (``benchmarks/fuzz.py``). Not a test module.

A program is a list of instructions over a pool of ``d x d`` fp32 values, drawn from one seed
(:func:`random_program`) and run by :func:`program_fn` (traced with fake tensors by
:func:`trace_program`, run eagerly on real inputs from :func:`program_inputs`). It mixes what
FSDP graphs hold with the shapes that broke the scheduler before:

- all-gathers of parameter shards (``w.to(bfloat16)`` or a bf16 shard, ``fsdp_fqn`` set), and
  reduce-scatters of fp32 values;
- collectives with several ``wait_tensor`` users, waited and read far apart;
- collective chains: an all-reduce of a waited all-gather result, before any compute reads it;
- zero-size collectives (an empty shard gathered, an empty value reduced);
- waits on graph inputs (a collective issued in another graph);
- multi-output ops (``topk``, ``var_mean``, ``native_layer_norm``), some outputs unread.

Every collective is waited at least once before the program returns; the outputs are the
values no later instruction read, and every wait's result.
"""

from __future__ import annotations

import dataclasses
import random

import torch

_c10d = torch.ops._c10d_functional

#: instruction kinds and their weights in a draw
_KINDS = {
    "mm": 3, "pointwise": 2, "add": 2, "topk": 1, "var_mean": 1, "layer_norm": 1,
    "gather": 3, "reduce_scatter": 2, "all_reduce": 1, "wait": 4, "input_wait": 1, "empty": 1,
}


@dataclasses.dataclass(frozen=True)
class Program:
    """A drawn program (see the module docstring).

    Attributes:
        seed: the seed it was drawn from (its reproducer).
        d: size of every square value.
        params: one entry per parameter shard: ``"fp32"`` (cast to bf16 before its all-gather),
            ``"bf16"`` or ``"empty"`` (a ``0 x d`` shard: a zero-size all-gather).
        n_input_waits: graph inputs that are waited on (issued in another graph).
        instructions: ``(kind, *args)`` tuples, run in order by :func:`program_fn`.
        primals: parameters are named ``primals_*`` (not releasable, as aot_autograd names them).
    """

    seed: int
    d: int
    params: tuple[str, ...]
    n_input_waits: int
    instructions: tuple[tuple, ...]
    primals: bool


def random_program(seed: int, *, max_instructions: int = 14) -> Program:
    """Draw a program from ``seed`` (same seed, same program)."""
    rnd = random.Random(seed)
    d = rnd.choice((2, 4))
    n_params = rnd.randint(1, 3)
    params = tuple(rnd.choices(("fp32", "bf16", "empty"), weights=(4, 2, 1))[0] for _ in range(n_params))
    n_input_waits = rnd.choice((0, 0, 1))
    kinds, weights = zip(*_KINDS.items())
    instructions: list[tuple] = []
    n_vals = 1  # the activation input
    pending = 0  # collectives issued so far (the interpreter tracks which are waited)
    gathered = [False] * n_params
    input_waited = 0
    for _ in range(rnd.randint(3, max_instructions)):
        kind = rnd.choices(kinds, weights)[0]
        pick = lambda: rnd.randrange(n_vals)  # noqa: E731
        if kind == "gather":
            free = [p for p in range(n_params) if not gathered[p]]
            if not free:
                continue
            p = rnd.choice(free)
            gathered[p] = True
            # an all-reduce of the gathered value at its first wait: a chain before any compute
            instructions.append(("gather", p, rnd.random() < 0.3))
            pending += 1
        elif kind in ("reduce_scatter", "all_reduce"):
            instructions.append((kind, pick()))
            pending += 1
        elif kind == "wait":
            if not pending:
                continue
            instructions.append(("wait", rnd.randrange(pending)))
        elif kind == "input_wait":
            if input_waited >= n_input_waits:
                continue
            instructions.append(("input_wait", input_waited))
            input_waited += 1
        elif kind == "empty":
            instructions.append(("empty", pick(), rnd.choice(("all_reduce", "reduce_scatter"))))
            pending += 1
            continue  # its wait adds a value only when waited
        elif kind in ("mm", "add"):
            instructions.append((kind, pick(), pick()))
        elif kind == "pointwise":
            instructions.append((kind, pick(), rnd.choice(("relu", "tanh", "neg"))))
        elif kind == "topk":
            instructions.append((kind, pick(), rnd.choice((1, d)), rnd.random() < 0.5))
        else:
            instructions.append((kind, pick(), rnd.random() < 0.5))
        if kind not in ("gather", "reduce_scatter", "all_reduce"):
            n_vals += 1
    return Program(seed=seed, d=d, params=params, n_input_waits=n_input_waits,
                   instructions=tuple(instructions), primals=rnd.random() < 0.5)


def arg_names(program: Program) -> list[str]:
    params = [f"primals_{i + 1}" if program.primals else f"w{i}" for i in range(len(program.params))]
    return [*params, "x", *(f"pre{i}" for i in range(program.n_input_waits))]


def program_fn(program: Program, group_name: str):
    """The program as a function of :func:`arg_names` (parameter shards, the activation, the
    tensors waited on as graph inputs) returning a tuple of tensors."""
    d = program.d
    n_params = len(program.params)

    def f(*args):
        params, x, pre = args[:n_params], args[n_params], args[n_params + 1:]
        vals = [x]
        read = [False]
        colls: list[dict] = []  # tensor, then after the first wait: its result

        def use(i: int) -> torch.Tensor:
            read[i] = True
            return vals[i]

        def add(v: torch.Tensor) -> None:
            vals.append(v)
            read.append(False)

        for ins in program.instructions:
            kind = ins[0]
            if kind == "gather":
                _, p, chained = ins
                w = params[p]
                shard = w.to(torch.bfloat16) if program.params[p] == "fp32" else w
                colls.append({"t": _c10d.all_gather_into_tensor(shard, 1, group_name), "kind": "gather",
                              "chained": chained, "waits": 0})
            elif kind == "reduce_scatter":
                colls.append({"t": _c10d.reduce_scatter_tensor(use(ins[1]) * 1.0, "sum", 1, group_name),
                              "kind": kind, "waits": 0})
            elif kind == "all_reduce":
                colls.append({"t": _c10d.all_reduce(use(ins[1]) + 0.0, "sum", group_name), "kind": kind, "waits": 0})
            elif kind == "empty":
                _, i, what = ins
                empty = use(i)[:0]
                t = (_c10d.all_reduce(empty + 0.0, "sum", group_name) if what == "all_reduce"
                     else _c10d.reduce_scatter_tensor(empty * 1.0, "sum", 1, group_name))
                colls.append({"t": t, "kind": "empty", "waits": 0})
            elif kind == "wait":
                c = colls[ins[1]]
                c["waits"] += 1
                add(_waited_value(c, d, group_name))
            elif kind == "input_wait":
                add(_c10d.wait_tensor(pre[ins[1]]) * 1.0)
            elif kind == "mm":
                add(torch.mm(use(ins[1]), use(ins[2])))
            elif kind == "add":
                add(use(ins[1]) + use(ins[2]))
            elif kind == "pointwise":
                add(getattr(torch, ins[2])(use(ins[1])))
            elif kind == "topk":
                _, i, k, both = ins
                values, indices = torch.ops.aten.topk.default(use(i), k)
                v = vals[i] + values[:, :1]
                add(v + indices[:, :1].float() if both else v)
            elif kind == "var_mean":
                _, i, both = ins
                var, mean = torch.ops.aten.var_mean.correction(use(i), [1], correction=0, keepdim=True)
                add(vals[i] - mean + var if both else vals[i] - mean)
            elif kind == "layer_norm":
                _, i, both = ins
                out, mean, rstd = torch.ops.aten.native_layer_norm.default(use(i), [d], None, None, 1e-5)
                add(out * rstd if both else out)
        waited = []
        for c in colls:  # every collective waited before the graph ends
            if not c["waits"]:
                c["waits"] += 1
                waited.append(_waited_value(c, d, group_name))
        unread = [v for v, r in zip(vals, read) if not r]
        return (*unread, *waited)

    return f


def _waited_value(c: dict, d: int, group_name: str) -> torch.Tensor:
    """One more wait on collective ``c``, as a ``d x d`` fp32 value: a gathered shard through
    an all-reduce at its first wait when drawn so (the chain), an empty result added as its sum."""
    r = _c10d.wait_tensor(c["t"])
    if c["kind"] == "gather" and c.get("chained") and c["waits"] == 1:
        r = _c10d.wait_tensor(_c10d.all_reduce(r, "sum", group_name))
    if r.numel() == 0 or c["kind"] == "empty":
        return torch.zeros(d, d) + r.float().sum()
    return r.float() * 1.0


def program_inputs(program: Program, make) -> tuple[torch.Tensor, ...]:
    """Inputs of :func:`program_fn`, made by ``make(*shape, dtype=...)`` (``torch.randn``
    under a FakeTensorMode, or a seeded generator's)."""
    d = program.d
    shapes = {"fp32": ((d, d), torch.float32), "bf16": ((d, d), torch.bfloat16), "empty": ((0, d), torch.float32)}
    params = [make(*shapes[p][0], dtype=shapes[p][1]) for p in program.params]
    return (*params, make(d, d, dtype=torch.float32), *(make(d, d, dtype=torch.float32)
                                                       for _ in range(program.n_input_waits)))


def real_program_inputs(program: Program, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return program_inputs(program, lambda *s, dtype: torch.randn(*s, generator=g, dtype=dtype))


def trace_program(program: Program, group_name: str) -> torch.fx.GraphModule:
    """The program traced with fake tensors (make_fx), FSDP metadata on its collectives: every
    all-gather of a parameter gets its ``fsdp_fqn`` and ``fsdp_param_index``, every
    reduce-scatter a ``fsdp_param_index``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        args = program_inputs(program, lambda *s, dtype: torch.randn(*s, dtype=dtype))
    names = arg_names(program)
    fn = program_fn(program, group_name)
    # make_fx names placeholders after the function's parameters
    ns: dict = {"fn": fn}
    exec(f"def traced({', '.join(names)}):\n    return fn({', '.join(names)})\n", ns)
    gm = make_fx(ns["traced"], tracing_mode="fake")(*args)
    gathers = [n for n in gm.graph.nodes if n.target is _c10d.all_gather_into_tensor.default]
    for i, n in enumerate(gathers):
        n.meta["fsdp_fqn"] = f"layers.{i}.w"
        n.meta["fsdp_param_index"] = i
    scatters = [n for n in gm.graph.nodes if n.target is _c10d.reduce_scatter_tensor.default]
    for i, n in enumerate(scatters):
        n.meta["fsdp_param_index"] = len(scatters) - 1 - i
    return gm
