"""The reproducibility report (do the digits survive another machine?): this run's numbers beside another run's.

``compare_against(this, other)`` takes two results directories (``rope-quant compare`` / ``run`` output) or two
claims JSONs (``pytest --rq-claims-out=DIR``: ``DIR/claims.json``). Each paired number (mean difference with its
90% interval) is printed beside the other run's, with the difference in units of this run's CI half-width;
every verdict that flipped is flagged; for claims JSONs, the claims whose per-seed values are identical value for value
are counted, and the others named. Claims JSONs name the decision rule they were decided under (``rule``; a
JSON without one predates the replicated rule: the 0.1.x single-replicate offset); two runs decided under
different rules are compared, and the header says that a flip may be the rule's. Each claim's float order
(σ_num and bias over the replicates, where recorded) is shown beside its interval. For directories, a number's
verdict is the decision rule's GREATER form (:mod:`rope_quant.core.verdict`; no numerical spread) on
``config − comparator``: worse / better / undecided.
Directories from another protocol or model are refused with the fields that differ (seeds, device and the
GPTQ float mode may differ: they are what a reproduction varies). Two claims JSONs of different models (each of
one model: its top-level ``model`` with the fingerprint of its files, or its rows' one model name) are compared
claim by claim, matched by the registry id: the header names each model with its fingerprint, protocol and
device, and the fields of the protocols that differ; a flipped verdict is then a difference between the models.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rope_quant.claims.values import decide_block
from rope_quant.core.verdict import RULE_OFFSET, Form
from rope_quant.io import markdown_table
from rope_quant.sweep.manifest import study_of

#: Config fields a reproduction may change without changing the protocol (matched as dotted-path suffixes:
#: ``seed``, ``runtime.device``, ``quant.w.gptq.float64``).
FREE_FIELDS = ("seed", "device", "gptq.float64")


def _free(key: str) -> bool:
    return any(key == f or key.endswith("." + f) for f in FREE_FIELDS)


class ReproduceError(ValueError):
    """Two runs that cannot be compared (missing, unreadable, different kinds or protocols)."""


@dataclass(frozen=True)
class Number:
    """One paired number of a run: its mean difference, interval and verdict."""

    label: str
    mean: float | None
    low: float | None
    high: float | None
    n: int | None
    verdict: str
    outcome: str = ""  # holds / fails / refuted / inconclusive (a flip compares these, not the verdict's text)
    float_order: str = ""  # σ_num and bias over the numerical replicates, where the claim recorded them
    deviation: str = ""  # the nearest protocol the claim ran under on this model (its title's "[deviation: …]")

    @property
    def half_width(self) -> float | None:
        if self.low is None or self.high is None:
            return None
        return (self.high - self.low) / 2.0


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: json.dumps(obj, sort_keys=True)}


def protocol(directory: Path) -> dict[str, set[str]]:
    """Per config field (dotted), the set of values over the manifest's cells, plus the manifest's kind."""
    manifest = json.loads((directory / "manifest.json").read_text())
    fields: dict[str, set[str]] = {"kind": {json.dumps(study_of(manifest))},
                                   "comparator": {json.dumps(manifest.get("comparator"))}}
    for cell in manifest.get("cells", []):
        for key, value in _flatten(cell.get("config", {})).items():
            fields.setdefault(key, set()).add(value)
    return {k: v for k, v in fields.items() if not _free(k)}


def _protocol_differences(a: dict[str, set[str]], b: dict[str, set[str]]) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {sorted(a.get(key, {'(absent)'}))} vs {sorted(b.get(key, {'(absent)'}))}")
    return out


def _dir_verdict(block: Mapping[str, Any]) -> str:
    v = decide_block(Form.GREATER, block)
    if v is None:
        return f"n={block.get('n')}: no interval"
    return {"holds": "worse (CI > 0)", "refuted": "better (CI < 0)"}.get(v.outcome.value, "undecided")


def _dir_numbers(directory: Path) -> tuple[dict[str, Number], dict[str, Any]]:
    from rope_quant.analysis.report import summarize  # deferred: the report stack

    summary = summarize(directory, write=False)
    numbers: dict[str, Number] = {}
    for name, block in summary.get("paired", {}).items():
        label = f"{name} − {block['comparator']}"
        numbers[label] = Number(label, block.get("mean"), block.get("low"), block.get("high"), block.get("n"),
                                _dir_verdict(block))
    for length, per in (summary.get("long_context") or {}).get("paired", {}).items():
        for name, block in per.items():
            label = f"{name} − {block['comparator']} @ L={length}"
            numbers[label] = Number(label, block.get("mean"), block.get("low"), block.get("high"), block.get("n"),
                                    _dir_verdict(block))
    env_path = directory / "env.json"
    env = json.loads(env_path.read_text()) if env_path.is_file() else {}
    return numbers, env


#: The rule of a claims JSON written before rules were named: one replicate seed, thresholds offset by |Δθ|.
LEGACY_RULE = "0.1.x: thresholds offset by one replicate's spread"


def _float_order(d: Mapping[str, Any]) -> str:
    fo = d.get("float_order") or {}
    if fo.get("sigma") is not None and fo.get("bias") is not None:
        return f"k={fo.get('k')}: σ {fo['sigma']:.3g}, bias {fo['bias']:+.3g}"
    if fo.get("reason"):
        return str(fo["reason"])
    return f"spread {d['noise']:.3g}" if isinstance(d.get("noise"), (int, float)) and d.get("noise") else ""


def _rule(payload: Mapping[str, Any]) -> str:
    """The rule a claims JSON was decided under: its top-level ``rule``, else its interval claims', else legacy."""
    if payload.get("rule"):
        return str(payload["rule"])
    rules = {(c.get("decision") or {}).get("rule") for c in payload.get("claims", []) if c.get("decision")}
    rules.discard(None)
    rules.discard(RULE_OFFSET)
    return " + ".join(sorted(str(r) for r in rules)) if rules else LEGACY_RULE


def read_claims_payload(path: str | Path) -> Mapping[str, Any]:
    """A claims JSON's payload (``pytest --rq-claims-out``, ``rope-quant claims`` / ``decide``), or a
    :class:`ReproduceError` naming why the file is not one."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ReproduceError(f"{path} is not valid JSON: {exc}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ReproduceError(f"{path} cannot be read ({exc})") from None
    if not isinstance(payload, Mapping) or "claims" not in payload:
        raise ReproduceError(f"{path} is not a claims JSON (no 'claims' key)")
    if not isinstance(payload["claims"], list):
        raise ReproduceError(f"{path}: 'claims' is not a list")
    return payload


_DEVIATION = " [deviation: "


def _title(claim: Mapping[str, Any]) -> tuple[str, str]:
    """A row's claim title without its deviation, and the deviation (empty when none)."""
    title = str(claim.get("claim", "?"))
    if _DEVIATION in title and title.endswith("]"):
        head, _, rest = title.partition(_DEVIATION)
        return head, rest[:-1]
    return title, ""


def _short(deviation: str) -> str:
    """A deviation's name without its reason: "R1 refused by the architecture (why): …" → its first words."""
    return deviation.split(" (")[0].split(":")[0].strip()


def short_deviation(title: str) -> str:
    """The short deviation a row's claim title names (``… [deviation: R1 refused by the architecture (why): …]``),
    or ""."""
    return _short(_title({"claim": title})[1])


def _shared_deviation(pairs: set[tuple[str | None, str | None]]) -> str | None:
    """The one deviation every row of both runs names (printed once, above the table), else None."""
    found = {d for pair in pairs for d in pair if d is not None}  # None: the row is absent from that run
    return found.pop() if len(found) == 1 and "" not in found else None


def run_of(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The one run a claims JSON describes (its top-level ``model``, ``protocol``, ``device``, or its one ``runs``
    entry); from its rows' model names alone when it has no description; empty when it holds several models."""
    if isinstance(payload.get("model"), Mapping):
        return {k: payload.get(k) for k in ("model", "protocol", "device")}
    runs = payload.get("runs") or []
    if len(runs) == 1 and isinstance(runs[0], Mapping):
        return dict(runs[0])
    names = {str(c.get("model", "?")) for c in payload.get("claims", []) if isinstance(c, Mapping)}
    return {"model": {"name": names.pop(), "fingerprint": None}} if len(names) == 1 else {}


def _model_key(run: Mapping[str, Any]) -> tuple[Any, Any] | None:
    model = run.get("model") or {}
    return (model.get("name"), model.get("fingerprint")) if model else None


def _claims_numbers(payload: Mapping[str, Any], by_id: bool = False) -> tuple[dict[str, Number], dict[str, Any]]:
    """Each claim's (and part's) number; keyed by claim and model, or (``by_id``: two models' tables) by the
    claim's registry id (its title, deviation left out, where a row has no id)."""
    numbers: dict[str, Number] = {}
    for claim in payload["claims"]:
        title, deviation = _title(claim)
        key = str(claim.get("id") or title) if by_id else f"{claim['claim']} [{claim.get('model', '?')}]"
        label = title if by_id else f"{title} [{claim.get('model', '?')}]"  # the deviation: once, in the header
        d = claim.get("decision") or {}
        mean, low, high, n = d.get("mean"), d.get("low"), d.get("high"), d.get("n")
        verdict = str(claim.get("verdict", ""))
        outcome = str(d.get("outcome") or verdict.split(":")[0].split(" ")[0])
        series = claim.get("numbers") or {}
        if mean is None:  # an every-seed claim: its first two per-seed series, paired (C1: pairwise_only − hadamard)
            pair = _paired_series(series)
            if pair is not None:
                label, (mean, low, high, n) = f"{label} ({pair[0]})", pair[1]
                key = key if by_id else f"{key} ({pair[0]})"
        numbers[key] = Number(label, mean, low, high, n, verdict, outcome, _float_order(d), deviation)
        for name, part in (claim.get("parts") or {}).items():  # a claim of parts: each part its own row
            if isinstance(part, Mapping) and part.get("outcome"):
                pm, pl, ph, pn = part.get("mean"), part.get("low"), part.get("high"), int(part.get("n") or 0)
                pair = _paired_series(series.get(name) or {}) if pm is None else None
                if pair is not None:  # an every-seed part: its treatment − control, paired
                    pm, pl, ph, pn = pair[1]
                numbers[f"{key} · {name}"] = Number(
                    f"{label} · {name}" + (f" ({pair[0]})" if pair else ""), pm, pl, ph, pn,
                    str(part.get("text") or part["outcome"]), str(part["outcome"]), _float_order(part), deviation)
    return numbers, {**(payload.get("machine") or {}), "_rule": _rule(payload)}


def _per_seed(payload: Mapping[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Each claim's per-seed series (the lists of its ``numbers``), keyed by registry id (its title where a row has
    none): what two runs of the same cells must reproduce value for value."""
    def lists(obj: Any, prefix: str = "") -> dict[str, list[float]]:  # a registry row nests them under its parts
        if isinstance(obj, Mapping):
            return {k: v for key, val in obj.items() for k, v in lists(val, f"{prefix}{key}.").items()}
        if isinstance(obj, list) and obj and all(isinstance(x, (int, float)) or isinstance(x, list) for x in obj):
            return {prefix[:-1]: obj}
        return {}

    out: dict[str, dict[str, list[float]]] = {}
    for claim in payload["claims"]:
        series = lists(claim.get("numbers") or {})
        if series:
            out[str(claim.get("id") or _title(claim)[0])] = series
    return out


def _identity_line(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """How many claims of both runs carry the same per-seed values, value for value, and which do not."""
    sa, sb = _per_seed(a), _per_seed(b)
    common = [k for k in sa if k in sb]
    differ = [k for k in common if sa[k] != sb[k]]
    text = (f"- per-seed values: {len(common) - len(differ)} of the {len(common)} claims in both runs identical, "
            "value for value")
    return text + (f"; differing: {', '.join(differ)}" if differ else "")


def _paired_series(numbers: Mapping[str, Any]) -> tuple[str, tuple[float, float, float, int]] | None:
    """("X − Y", (mean, low, high, n)) of the first two equal-length per-seed series of a claim, or None."""
    from rope_quant.core import stats

    series = [(k, v) for k, v in numbers.items() if isinstance(v, list) and len(v) >= 2
              and all(isinstance(x, (int, float)) for x in v)]
    if len(series) < 2 or len(series[0][1]) != len(series[1][1]):
        return None
    (a, x), (b, y) = series[:2]
    ci = stats.paired_ci(x, y)
    return f"{a} − {b}", (ci.mean, ci.low, ci.high, ci.n)


def _load(path: Path) -> tuple[str, dict[str, Number], dict[str, Any], Mapping[str, Any] | None]:
    if path.is_dir():
        if (path / "manifest.json").is_file():
            return "directory", *_dir_numbers(path), None
        if (path / "claims.json").is_file():
            path = path / "claims.json"
        else:
            raise ReproduceError(f"{path} holds neither a manifest.json (results directory) nor a claims.json")
    if path.is_file():
        payload = read_claims_payload(path)
        return "claims", *_claims_numbers(payload), payload
    raise ReproduceError(f"{path} does not exist")


def _run_line(run: Mapping[str, Any]) -> str:
    """A model with its fingerprint, its protocol and its device, in one line."""
    model, protocol, device = (run.get(k) or {} for k in ("model", "protocol", "device"))
    line = f"{model.get('name', '?')} (fingerprint {model.get('fingerprint') or 'not recorded'})"
    if protocol:
        evals = protocol.get("eval_windows")
        line += (f"; protocol {protocol.get('name') or '?'}: {protocol.get('bits')}, {protocol.get('weights')}, "
                 f"{protocol.get('calib_windows')} x {protocol.get('seqlen')} calibration, "
                 f"{'every' if evals is None else evals} eval windows, seeds {protocol.get('seeds')}")
    if device:
        line += f"; device {device.get('cuda_name') or device.get('requested')}"
    return line


def _cross_model_lines(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The header of two models' claims tables: each run, and the protocol fields that differ."""
    pa, pb = a.get("protocol") or {}, b.get("protocol") or {}
    differ = [f"{k}: {pa.get(k)!r} vs {pb.get(k)!r}" for k in dict.fromkeys([*pa, *pb])
              if k != "seeds" and pa.get(k) != pb.get(k)]
    return [f"- **two models**, rows matched by claim id: this {_run_line(a)}; other {_run_line(b)}",
            "- a flipped verdict is a difference between the models (or their protocols), not a failed reproduction"
            + (f"; protocol fields that differ: {'; '.join(differ)}" if differ else "")]


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:+.{digits}f}"


def _ci(n: Number) -> str:
    if n.mean is None:
        return "–"
    if n.low is None or n.high is None:
        return _fmt(n.mean)
    return f"{n.mean:+.3f} ({n.low:+.3f}, {n.high:+.3f})"


def _machine_line(machine: Mapping[str, Any]) -> str:
    if not machine:
        return "machine not recorded"
    if "threads" in machine:  # the pytest plugin's machine record
        mode = (machine.get("float_mode") or {}).get("run")
        return (f"{machine.get('cpu_model')}, {machine.get('threads')} threads, BLAS {machine.get('blas')}, torch "
                f"{machine.get('torch')}, transformers {machine.get('transformers')}" + (f", {mode}" if mode else ""))
    pk = machine.get("packages") or {}
    dev = machine.get("device") or {}
    return (f"{machine.get('cpu_model') or machine.get('platform', '?')}, {machine.get('cpu_count', '?')} CPUs, "
            f"{dev.get('torch_threads', '?')} threads, torch {pk.get('torch', '?')}, "
            f"transformers {pk.get('transformers', '?')}")


#: Outcomes that are decisions, by direction: a "holds" against a "refuted"/"fails" (or, for directories, a
#: "worse" against a "better") is a contradiction; either against "inconclusive"/"undecided" is not.
_DIRECTION = {"holds": 1, "refuted": -1, "fails": -1, "worse": 1, "better": -1}


def _contradicts(a: str, b: str) -> bool:
    """Two outcomes decided in opposite directions (the rule's ≤ 5% per float order says this should not happen)."""
    da, db = _DIRECTION.get(a.split(" ")[0]), _DIRECTION.get(b.split(" ")[0])
    return da is not None and db is not None and da != db


def compare_against(this: str | Path, other: str | Path) -> str:
    """Markdown: each number of ``this`` beside ``other``'s, Δ in units of this run's CI half-width, flipped
    verdicts flagged. Raises :class:`ReproduceError` for runs that cannot be compared."""
    a_path, b_path = Path(this), Path(other)
    a_kind, a, a_env, a_payload = _load(a_path)
    b_kind, b, b_env, b_payload = _load(b_path)
    if a_kind != b_kind:
        raise ReproduceError(f"cannot compare a {a_kind} ({a_path}) with a {b_kind} ({b_path}): give two results "
                             "directories or two claims JSONs")
    cross: list[str] = []
    if a_payload is not None and b_payload is not None:
        cross.append(_identity_line(a_payload, b_payload))
        a_run, b_run = run_of(a_payload), run_of(b_payload)
        ka, kb = _model_key(a_run), _model_key(b_run)
        if ka is not None and kb is not None and ka != kb:  # two models' tables: claim by claim
            a, b = _claims_numbers(a_payload, by_id=True)[0], _claims_numbers(b_payload, by_id=True)[0]
            cross += _cross_model_lines(a_run, b_run)
    if a_kind == "directory":
        diff = _protocol_differences(protocol(a_path), protocol(b_path))
        if diff:
            raise ReproduceError(f"{b_path} is from another protocol or model; fields that differ: " + "; ".join(diff))
    rows: list[dict[str, str]] = []
    flipped, contradictions = 0, 0
    pairs = {(x.deviation if x else None, y.deviation if y else None)
             for x, y in ((a.get(k), b.get(k)) for k in {*a, *b})}
    shared = _shared_deviation(pairs)
    deviations = shared is None and any(d for pair in pairs for d in pair)
    for key in [*a, *(k for k in b if k not in a)]:
        x, y = a.get(key), b.get(key)
        found = x or y
        label = found.label if found else key
        row = {"number": label, "this": _ci(x) if x else "(absent)", "other": _ci(y) if y else "(absent)",
               "Δ": "–", "Δ / half-width": "–", "verdict (this → other)": ""}
        if a_kind == "claims":
            row["float order (this → other)"] = " → ".join(
                dict.fromkeys(z.float_order or "–" for z in (x, y) if z)) if (x or y) else ""
        if deviations:
            row["deviation (this → other)"] = " → ".join(_short(z.deviation) or "none" if z else "(absent)"
                                                        for z in (x, y))
        only = x or y
        if only is not None and not (x and y):  # a number only one run has (a part the other did not record)
            row["verdict (this → other)"] = only.verdict
        if x and y:
            if x.mean is not None and y.mean is not None:
                delta = y.mean - x.mean
                row["Δ"] = _fmt(delta)
                hw = x.half_width
                row["Δ / half-width"] = f"{delta / hw:+.2f}" if hw else "–"
            flip = (x.outcome or x.verdict) != (y.outcome or y.verdict)
            clash = flip and _contradicts(x.outcome or x.verdict, y.outcome or y.verdict)
            flipped += flip
            contradictions += clash
            same = x.verdict == y.verdict
            kind = "**CONTRADICTION**" if clash else "**FLIPPED** (decided ↔ inconclusive)"
            row["verdict (this → other)"] = (f"{kind} {x.verdict} → {y.verdict}" if flip else
                                             x.verdict if same else f"{x.verdict} → {y.verdict}")
        rows.append(row)
    rules = [env.pop("_rule", None) for env in (a_env, b_env)]
    head = [f"# Reproducibility: {a_path} against {b_path}", "",
            f"- this: {_machine_line(a_env)}", f"- other: {_machine_line(b_env)}", *cross,
            *([f"- deviation, every claim of both runs: {shared}"] if shared else []),
            *([f"- rule: {rules[0]}"] if rules[0] and rules[0] == rules[1] else
              [f"- **different decision rules**: this {rules[0]}; other {rules[1]}: a flip may be the rule's, not "
               "the data's"] if rules[0] else []),
            f"- {len(rows)} numbers, {flipped} verdict(s) flipped ({contradictions} contradiction(s): one run decided "
            "what the other decided the opposite way; the rest between a decision and inconclusive); Δ = other − "
            "this, in units of the half-width of this run's interval (90%, or the sequential rule's per-look level, "
            "e.g. 98.8%, where the number was decided under it)", ""]
    return "\n".join(head) + markdown_table(rows, list(rows[0]) if rows else ["number"]) + "\n"


def add_against_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--against OTHER`` for ``rope-quant report DIR``."""
    parser.add_argument("--against", default=None, metavar="OTHER",
                        help="print DIR's numbers beside OTHER's (a results directory or a claims JSON), with "
                             "each difference in CI half-widths and every flipped verdict flagged")
    return parser


def run_against(this: str, other: str, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The ``report DIR --against OTHER`` action: 0 and the report on ``out``; 2 and ``error: ...`` otherwise."""
    try:
        text = compare_against(this, other)
    except ReproduceError as exc:
        print(f"error: {exc}", file=err or sys.stderr)
        return 2
    print(text, file=out or sys.stdout, end="")
    return 0
