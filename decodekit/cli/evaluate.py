"""`decodekit eval`: the same lm-evaluation-harness tasks run with each method asked for, one table to compare them
(per task the metric with its stderr, tokens/s and mean new tokens of the generation requests), lm-eval's results
JSON per method and a comparison picture (SVG) under --output. A method's results are written as soon as it ends, so
Ctrl-C keeps what finished."""

from __future__ import annotations

import html
import json
import re
import time
from pathlib import Path

GREEDY = "greedy"  # in --compare: no method, the model's own greedy decoding


def cmd_eval(args) -> int:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager

        from ..integrations.lm_eval import DecodekitLM
    except ImportError as error:
        raise ImportError(
            f"decodekit eval needs lm-evaluation-harness: pip install 'decodekit[eval]' ({error})"
        ) from None
    from ..loading import AutoModelForCausalLM, AutoTokenizer
    from .arguments import parse_method_args

    tasks = [t for t in args.tasks.split(",") if t]
    methods = ([args.method] if args.method else []) + [m for m in (args.compare or "").split(",") if m]
    methods = list(dict.fromkeys(methods or [GREEDY]))
    from ..loading.default import default_model_path

    path = args.model or default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    manager = TaskManager(include_path=args.include_path) if args.include_path else TaskManager()
    output = Path(args.output) if args.output else None
    fields = parse_method_args(args.arg)  # the --arg fields, for every method but greedy
    rows: dict[tuple[str, str], dict] = {}  # (task, method) -> what that run gave
    for method in methods:
        for task in tasks:  # a task at a time: tokens/s and new tokens are each task's own
            lm = DecodekitLM(
                model=model,
                tokenizer=tokenizer,
                method=None if method == GREEDY else method,
                method_args=fields if method != GREEDY else {},
                trust_remote_code=args.trust_remote_code,
                compile=args.compile,
            )
            start = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model=lm, tasks=[task], task_manager=manager, limit=args.limit, log_samples=False
            )
            rows[(task, method)] = {"results": results["results"], "new_tokens": lm.new_tokens,
                                    "seconds": time.perf_counter() - start, "generations": lm.generations}  # fmt: skip
            if output is not None:
                output.mkdir(parents=True, exist_ok=True)
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{task}-{method}")
                (output / f"results-{name}.json").write_text(json.dumps(results["results"], indent=2, default=str))
    table = comparison(rows, tasks)
    print(render(table))
    if output is not None:
        (output / "comparison.json").write_text(json.dumps(table, indent=2))
        (output / "comparison.svg").write_text(picture(table))
        print(f"\nwritten: {output}/results-<task>-<method>.json, comparison.json, comparison.svg")
    return 0


def comparison(rows: dict[tuple[str, str], dict], tasks: list[str]) -> list[dict]:
    """One row per task and method: the task's first metric, its stderr, and where the task generates, tokens/s and
    mean new tokens."""
    table = []
    for (task, method), row in rows.items():
        metrics = row["results"].get(task, {})
        name = next((k for k in metrics if "," in k and "_stderr" not in k and k != "alias"), None)
        if name is None:
            continue
        stderr = metrics.get(name.replace(",", "_stderr,", 1))
        generated = row["generations"] > 0
        table.append(
            {
                "task": task,
                "method": method,
                "metric": name.split(",")[0],
                "value": metrics[name],
                "stderr": stderr if isinstance(stderr, (int, float)) else None,
                "tokens_per_s": row["new_tokens"] / row["seconds"] if generated else None,
                "mean_new_tokens": row["new_tokens"] / row["generations"] if generated else None,
            }
        )
    order = {task: i for i, task in enumerate(tasks)}
    return sorted(table, key=lambda r: order.get(r["task"], len(order)))  # stable: the methods in their order


def render(table: list[dict]) -> str:
    task = max([len("task"), *(len(r["task"]) for r in table)])
    method = max([len("method"), *(len(r["method"]) for r in table)])
    lines = [f"{'task':<{task}}  {'method':<{method}}  {'metric':<12} {'value':>16} {'tokens/s':>9} {'new tokens':>10}"]
    for r in table:
        value = f"{r['value']:.4f}" + (f" ± {r['stderr']:.4f}" if r["stderr"] is not None else "")
        speed = f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-"
        new = f"{r['mean_new_tokens']:.1f}" if r["mean_new_tokens"] else "-"
        lines.append(
            f"{r['task']:<{task}}  {r['method']:<{method}}  {r['metric']:<12} {value:>16} {speed:>9} {new:>10}"
        )
    return "\n".join(lines)


def picture(table: list[dict]) -> str:
    """An SVG: a bar per task and method (the metric, its stderr as a whisker), one colour per method."""
    colours = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377"]
    methods = list(dict.fromkeys(r["method"] for r in table))
    tasks = list(dict.fromkeys(r["task"] for r in table))
    bar, gap, height, left = 28, 24, 220, 40
    group = max(len(methods) * bar, 7 * max(len(t) for t in tasks)) + gap  # room for the task's name beneath
    width = left + len(tasks) * group + 220
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 60}" font-family="sans-serif">'
    ]
    parts.append(f'<line x1="{left}" y1="{height}" x2="{width - 200}" y2="{height}" stroke="#333"/>')
    for value in (0.0, 0.5, 1.0):  # the metric's scale (accuracies and exact matches are fractions)
        y = height - value * (height - 20)
        parts.append(f'<text x="4" y="{y + 4}" font-size="11">{value:.1f}</text>')
        parts.append(f'<line x1="{left - 4}" y1="{y}" x2="{width - 200}" y2="{y}" stroke="#ddd"/>')
    for t, task in enumerate(tasks):
        x0 = left + t * group
        parts.append(f'<text x="{x0}" y="{height + 18}" font-size="12">{html.escape(task)}</text>')
        for m, method in enumerate(methods):
            row = next((r for r in table if r["task"] == task and r["method"] == method), None)
            if row is None:
                continue
            value = max(0.0, min(1.0, float(row["value"])))
            x, h = x0 + m * bar, value * (height - 20)
            parts.append(
                f'<rect x="{x}" y="{height - h}" width="{bar - 4}" height="{h}" fill="{colours[m % len(colours)]}">'
                f"<title>{html.escape(method)}: {row['metric']} {row['value']:.4f}</title></rect>"
            )
            if row["stderr"]:
                e = row["stderr"] * (height - 20)
                c = x + (bar - 4) / 2
                parts.append(f'<line x1="{c}" y1="{height - h - e}" x2="{c}" y2="{height - h + e}" stroke="#000"/>')
    for m, method in enumerate(methods):
        y = 20 + 18 * m
        parts.append(
            f'<rect x="{width - 190}" y="{y - 10}" width="12" height="12" fill="{colours[m % len(colours)]}"/>'
        )
        parts.append(f'<text x="{width - 172}" y="{y}" font-size="12">{html.escape(method)}</text>')
    parts.append(speed_panel(table, methods, colours, height, width - 190 + 180))
    parts.append("</svg>")
    return "\n".join(parts).replace(f'width="{width}"', f'width="{width + 300}"', 1)


def speed_panel(table: list[dict], methods: list[str], colours: list[str], height: int, x0: float) -> str:
    """The metric against tokens/s of each generating task and method: a point each in the method's colour (its task
    in the point's title)."""
    points = [r for r in table if r["tokens_per_s"]]
    if not points:
        return ""
    fastest = max(r["tokens_per_s"] for r in points)
    size = 240
    parts = [
        f'<g transform="translate({x0},0)">',
        f'<line x1="0" y1="{height}" x2="{size}" y2="{height}" stroke="#333"/>',
        f'<line x1="0" y1="20" x2="0" y2="{height}" stroke="#333"/>',
        f'<text x="0" y="{height + 18}" font-size="11">tokens/s (0 to {fastest:.1f})</text>',
        '<text x="0" y="12" font-size="11">metric against speed</text>',
    ]
    for r in points:
        x = r["tokens_per_s"] / fastest * (size - 20)
        y = height - max(0.0, min(1.0, float(r["value"]))) * (height - 20)
        colour = colours[methods.index(r["method"]) % len(colours)]
        parts.append(
            f'<circle cx="{x}" cy="{y}" r="5" fill="{colour}"><title>{html.escape(r["method"])}: {r["task"]} '
            f"{r['value']:.4f} at {r['tokens_per_s']:.1f} tokens/s</title></circle>"
        )
    parts.append("</g>")
    return "\n".join(parts)
