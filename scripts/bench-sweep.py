#!/usr/bin/env python3
"""Runs `clshard bench` over a grid of deployments, merges the JSON and draws PNG plots.

    scripts/bench-sweep.py configs/bench/tiny.yaml [--out DIR] [--clshard EXE] [--set KEY=VALUE]

The grid file (configs/bench/*.yaml) names the bench flags and the deployments; each deployment
may have variants, sets of deployment keys to override (dotted paths: devices.split,
parallel.data, ...), written as deployment files under OUT/deployments/. A variant may also
set `mpirun: N` to run under `mpirun -np N` (deployments with cluster.transport: mpi). Runs of
one `group` (default: the deployment's name) are compared for scaling efficiency.

Writes OUT/runs/<run>.json (one per run, as `clshard bench --json` writes it), OUT/sweep.json
(every run with its environment and records) and, with gnuplot, OUT/throughput.png (decode and
prefill tokens/s against batch per run), OUT/scaling.png (decode throughput per device against
the device count, relative to the group's smallest device count) and OUT/latency.png (time to
first token and inter-token latency, p50/p90/p99, against batch).

Only the standard library and python3-yaml (Debian) are used; gnuplot-nox draws the plots.
Exits with 1 when a run failed (the others still run) and 2 on a bad grid file.
"""

import argparse
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Deployment keys holding paths that are relative to the deployment file's directory.
PATH_KEYS = ("model.path", "speculative.draft_model", "job.input", "job.output")
BENCH_KEYS = {"batch", "prompt_len", "gen_len", "seed", "roofline", "warmup"}
ENTRY_KEYS = {"name", "file", "group", "make_model", "variants"}


class GridError(Exception):
    pass


def size_list(where, value):
    """A positive integer or a list of them, as `clshard bench` takes it ("1,8,32")."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                            for v in items):
        raise GridError(f"{where}: expected a positive integer or a list of them, got {value!r}")
    return ",".join(str(v) for v in items)


def get_dotted(doc, key):
    node = doc
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_dotted(doc, key, value):
    parts = key.split(".")
    node = doc
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise GridError(f"{key}: {part} is not a section")
    node[parts[-1]] = value


def parse_override(text):
    if "=" not in text:
        raise GridError(f"--set {text}: expected KEY=VALUE (e.g. model.path=/tmp/model)")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value) if value else ""


def load_grid(path):
    try:
        with open(path, encoding="utf-8") as f:
            grid = yaml.safe_load(f)
    except OSError as e:
        raise GridError(f"{path}: cannot read: {e.strerror}")
    except yaml.YAMLError as e:
        raise GridError(f"{path}: not YAML: {e}")
    if not isinstance(grid, dict):
        raise GridError(f"{path}: expected a mapping with bench: and deployments:")
    unknown = set(grid) - {"bench", "deployments", "description"}
    if unknown:
        raise GridError(f"{path}: unknown key(s) {sorted(unknown)} (expected bench, deployments, "
                        "description)")
    bench = grid.get("bench") or {}
    if not isinstance(bench, dict):
        raise GridError(f"{path}: bench: expected a mapping")
    unknown = set(bench) - BENCH_KEYS
    if unknown:
        raise GridError(f"{path}: bench: unknown key(s) {sorted(unknown)} (expected "
                        f"{sorted(BENCH_KEYS)})")
    flags = []
    for key, flag in (("batch", "--batch"), ("prompt_len", "--prompt-len"),
                      ("gen_len", "--gen-len")):
        if key not in bench:
            raise GridError(f"{path}: bench.{key}: missing")
        flags += [flag, size_list(f"{path}: bench.{key}", bench[key])]
    if "seed" in bench:
        flags += ["--seed", str(int(bench["seed"]))]
    if bench.get("roofline"):
        flags.append("--roofline")
    if bench.get("warmup") is False:
        flags.append("--no-warmup")
    entries = grid.get("deployments")
    if not isinstance(entries, list) or not entries:
        raise GridError(f"{path}: deployments: expected a non-empty list")
    base = os.path.dirname(os.path.abspath(path))
    runs = []
    for i, e in enumerate(entries):
        where = f"{path}: deployments[{i}]"
        if not isinstance(e, dict):
            raise GridError(f"{where}: expected a mapping with name and file")
        unknown = set(e) - ENTRY_KEYS
        if unknown:
            raise GridError(f"{where}: unknown key(s) {sorted(unknown)} (expected "
                            f"{sorted(ENTRY_KEYS)})")
        for key in ("name", "file"):
            if not isinstance(e.get(key), str) or not e[key]:
                raise GridError(f"{where}.{key}: missing")
        file = os.path.normpath(os.path.join(base, e["file"]))
        if not os.path.isfile(file):
            raise GridError(f"{where}.file: no such file: {file}")
        variants = e.get("variants") or [{}]
        if not isinstance(variants, list):
            raise GridError(f"{where}.variants: expected a list of mappings")
        make = e.get("make_model")
        if make is not None and (not isinstance(make, dict) or "preset" not in make):
            raise GridError(f"{where}.make_model: expected {{preset: NAME, dtype: ...}}")
        for j, v in enumerate(variants):
            if not isinstance(v, dict):
                raise GridError(f"{where}.variants[{j}]: expected a mapping of overrides")
            v = dict(v)
            suffix = v.pop("name", None)
            mpirun = v.pop("mpirun", None)
            if mpirun is not None and (not isinstance(mpirun, int) or mpirun < 1):
                raise GridError(f"{where}.variants[{j}].mpirun: expected a positive integer")
            if suffix is None and len(variants) > 1:
                suffix = "-".join(f"{k.split('.')[-1]}{val}" for k, val in v.items()) or str(j)
            name = e["name"] + (f"-{suffix}" if suffix else "")
            runs.append({"name": name, "group": e.get("group", e["name"]), "file": file,
                         "overrides": v, "mpirun": mpirun, "make_model": make})
    names = [r["name"] for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GridError(f"{path}: run names repeat: {dup} (give the variants names)")
    return flags, runs


def write_deployment(run, extra, out_dir):
    """The run's deployment file: the original when nothing is overridden, else a copy with the
    overrides and its relative paths made absolute, under out_dir/deployments/."""
    overrides = dict(run["overrides"])
    overrides.update(extra)
    with open(run["file"], encoding="utf-8") as f:
        doc = yaml.safe_load(f) or {}
    base = os.path.dirname(run["file"])
    model_path = get_dotted(doc, "model.path")
    if not overrides:
        return run["file"], (os.path.join(base, model_path) if model_path else None)
    doc = copy.deepcopy(doc)
    for key in PATH_KEYS:
        value = get_dotted(doc, key)
        if isinstance(value, str) and value and not os.path.isabs(value):
            set_dotted(doc, key, os.path.normpath(os.path.join(base, value)))
    for key, value in overrides.items():
        set_dotted(doc, key, value)
    path = os.path.join(out_dir, "deployments", run["name"] + ".yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# {run['name']}: {os.path.relpath(run['file'], REPO)} with {overrides}\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    return path, get_dotted(doc, "model.path")


def run_one(run, flags, extra, args):
    deploy, model_path = write_deployment(run, extra, args.out)
    make = run["make_model"]
    if make and model_path and not os.path.isfile(os.path.join(model_path, "config.json")):
        cmd = [args.clshard, "make-model", "--preset", str(make["preset"]), "--out", model_path]
        if "dtype" in make:
            cmd += ["--dtype", str(make["dtype"])]
        if "seed" in make:
            cmd += ["--seed", str(make["seed"])]
        print(f"sweep: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    json_path = os.path.join(args.out, "runs", run["name"] + ".json")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    cmd = [args.clshard, "bench", deploy, *flags, "--json", json_path]
    if run["mpirun"]:
        mpirun = ["mpirun", "-np", str(run["mpirun"]), "--oversubscribe"]
        if os.geteuid() == 0:
            mpirun.append("--allow-run-as-root")
        cmd = mpirun + cmd
    print(f"sweep: [{run['name']}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    table = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(f"== {run['name']}\n{table.stdout}")
    if table.returncode != 0:
        raise RuntimeError(f"clshard bench exited with {table.returncode}")
    with open(json_path, encoding="utf-8") as f:
        result = json.load(f)
    env = result["environment"]
    ranks = env["deployment"].get("mpi_ranks", 0)
    return {"name": run["name"], "group": run["group"], "deployment": deploy,
            "devices": ranks if ranks else len(env["devices"]),
            "environment": env, "records": result["records"]}


# ---- plots ------------------------------------------------------------------------------------

def gp_string(s):
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def series_of(runs, metric):
    """{title: [(batch, value)]} per run and (prompt_len, gen_len), for a record metric."""
    shapes = {(r["prompt_len"], r["gen_len"]) for run in runs for r in run["records"]}
    out = {}
    for run in runs:
        for p, g in sorted(shapes):
            pts = [(r["batch"], r[metric]) for r in run["records"]
                   if (r["prompt_len"], r["gen_len"]) == (p, g) and r.get(metric) is not None]
            if pts:
                title = run["name"] + (f" p{p} g{g}" if len(shapes) > 1 else "")
                out[title] = sorted(pts)
    return out


def write_series(dat_dir, stem, series):
    files = []
    for k, (title, pts) in enumerate(series.items()):
        path = os.path.join(dat_dir, f"{stem}-{k}.dat")
        with open(path, "w", encoding="utf-8") as f:
            for x, y in pts:
                f.write(f"{x} {y}\n")
        files.append((path, title))
    return files


def plot_command(files, style="linespoints lw 2 pt 7", dash=None):
    parts = []
    for k, (path, title) in enumerate(files):
        dt = f" dt {dash}" if dash else ""
        parts.append(f"{gp_string(path)} using 1:2 with {style}{dt} lc {k + 1} "
                     f"title {gp_string(title)}")
    return ", ".join(parts) if parts else "NaN notitle"


def batch_axis(runs):
    batches = sorted({r["batch"] for run in runs for r in run["records"]})
    lines = ["set xlabel 'batch (concurrent requests)'"]
    if len(batches) > 1 and batches[-1] / batches[0] >= 4:
        lines.append("set logscale x 2")
    lines.append("set xtics (" + ", ".join(f'"{b}" {b}' for b in batches) + ")")
    pad = 0.8 if len(batches) > 1 else 0.5
    lines.append(f"set xrange [{batches[0] * pad}:{batches[-1] / pad}]")
    return "\n".join(lines)


def header(png, title, width=1100, height=480):
    return (f"set terminal pngcairo size {width},{height} font 'sans,9' noenhanced\n"
            f"set output {gp_string(png)}\nset title {gp_string(title)}\n"
            "set grid\nset key outside right top\nset yrange [0:*]\n")


def plot_scripts(runs, out, machine):
    dat = os.path.join(out, "plot-data")
    os.makedirs(dat, exist_ok=True)
    scripts = {}

    decode = write_series(dat, "decode", series_of(runs, "decode_tok_s"))
    prefill = write_series(dat, "prefill", series_of(runs, "prefill_tok_s"))
    png = os.path.join(out, "throughput.png")
    scripts[png] = (
        header(png, "", 1200, 480) + "unset title\nset multiplot layout 1,2 title "
        + gp_string(f"clshard bench: throughput against batch ({machine})") + "\n"
        + batch_axis(runs) + "\nset ylabel 'decode tokens/s'\nset key inside left top\n"
        + "plot " + plot_command(decode) + "\n"
        + "set ylabel 'prefill tokens/s'\nplot " + plot_command(prefill) + "\n"
        + "unset multiplot\n")

    # Scaling: per group, batch and shape, decode tokens/s per device relative to the group's
    # smallest device count (1.0 = perfect scaling).
    series = {}
    groups = sorted({run["group"] for run in runs})
    for group in groups:
        members = [run for run in runs if run["group"] == group]
        base_n = min(run["devices"] for run in members)
        shapes = sorted({(r["batch"], r["prompt_len"], r["gen_len"])
                         for run in members for r in run["records"]})
        for b, p, g in shapes:
            def tput(run):
                for r in run["records"]:
                    if (r["batch"], r["prompt_len"], r["gen_len"]) == (b, p, g):
                        return r.get("decode_tok_s") or r.get("output_tok_s")
                return None
            base = [tput(run) for run in members if run["devices"] == base_n]
            base = [v for v in base if v]
            if not base:
                continue
            pts = sorted((run["devices"], (tput(run) / base[0]) / (run["devices"] / base_n))
                         for run in members if tput(run))
            series[f"{group} b{b} p{p} g{g}"] = pts
    scaling = write_series(dat, "scaling", series)
    counts = sorted({run["devices"] for run in runs})
    png = os.path.join(out, "scaling.png")
    top = max([1.2] + [1.1 * y for pts in series.values() for _, y in pts])
    scripts[png] = (
        header(png, f"scaling efficiency against device count ({machine})", 1000, 520)
        + "set xlabel 'devices (sub-devices or MPI ranks)'\n"
        + "set ylabel 'decode tok/s per device / same at the group''s fewest devices'\n"
        + "set xtics (" + ", ".join(f'"{n}" {n}' for n in counts) + ")\n"
        + f"set xrange [{counts[0] - 0.5}:{counts[-1] + 0.5}]\nset yrange [0:{top:.2f}]\n"
        + "plot 1 with lines lc rgb 'gray' dt 2 title 'ideal', " + plot_command(scaling) + "\n")

    png = os.path.join(out, "latency.png")
    lines = [header(png, "", 1200, 560), "unset title", "set multiplot layout 1,2 title "
             + gp_string(f"clshard bench: latency percentiles, p50 solid, p90 dashed, p99 "
                         f"dotted ({machine})"), batch_axis(runs),
             "set key outside below horizontal"]
    for metric, label in (("ttft", "time to first token, ms"), ("itl", "inter-token latency, ms")):
        parts = []
        for pct, dash in (("p50", None), ("p90", 2), ("p99", 3)):
            files = write_series(dat, f"{metric}-{pct}", series_of(runs, f"{metric}_ms_{pct}"))
            if pct != "p50":
                files = [(path, f"{title} {pct}") for path, title in files]
            parts.append(plot_command(files, dash=dash))
        lines.append(f"set ylabel '{label}'\nplot " + ", ".join(parts))
    lines.append("unset multiplot")
    scripts[png] = "\n".join(lines) + "\n"
    return scripts


def draw(runs, out):
    gnuplot = shutil.which("gnuplot")
    if not gnuplot:
        print("sweep: gnuplot not found (scripts/setup.sh installs gnuplot-nox): no plots",
              file=sys.stderr)
        return []
    env = runs[0]["environment"]
    machine = env["host"]["cpu"] or "?"
    dev = env["devices"][0]
    machine = f"{machine}, {env['host']['hardware_threads']} threads, {dev['platform']} " \
              f"{dev['driver_version']}"
    written = []
    for png, script in plot_scripts(runs, out, machine).items():
        gp = png[:-4] + ".gp"
        with open(gp, "w", encoding="utf-8") as f:
            f.write(script)
        res = subprocess.run([gnuplot, gp], stderr=subprocess.PIPE, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"gnuplot {gp} failed: {res.stderr.strip()}")
        written.append(png)
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("grid", help="grid file (configs/bench/*.yaml)")
    ap.add_argument("--out", help="output directory (default .cache/bench/<grid name>)")
    ap.add_argument("--clshard", default=os.path.join(REPO, "build", "clshard"),
                    help="the clshard executable (default build/clshard)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a deployment key in every run (e.g. model.path=DIR)")
    ap.add_argument("--no-plots", action="store_true", help="merge the JSON only")
    args = ap.parse_args()
    try:
        flags, runs = load_grid(args.grid)
        extra = dict(parse_override(s) for s in args.set)
    except GridError as e:
        print(f"bench-sweep: error: {e}", file=sys.stderr)
        return 2
    if not os.access(args.clshard, os.X_OK):
        print(f"bench-sweep: error: --clshard {args.clshard}: not an executable (build first)",
              file=sys.stderr)
        return 2
    stem = os.path.splitext(os.path.basename(args.grid))[0]
    args.out = args.out or os.path.join(REPO, ".cache", "bench", stem)
    os.makedirs(args.out, exist_ok=True)

    done, failed = [], []
    for run in runs:
        try:
            done.append(run_one(run, flags, extra, args))
        except (RuntimeError, subprocess.CalledProcessError, OSError, GridError) as e:
            print(f"sweep: [{run['name']}] failed: {e}", file=sys.stderr, flush=True)
            failed.append(run["name"])
    with open(args.grid, "rb") as f:
        grid_bytes = f.read()
    merged = {"grid": {"file": os.path.abspath(args.grid),
                       "sha256": hashlib.sha256(grid_bytes).hexdigest(),
                       "contents": grid_bytes.decode("utf-8", "replace"),
                       "overrides": {k: v for k, v in extra.items()}},
              "failed": failed, "runs": done}
    sweep_json = os.path.join(args.out, "sweep.json")
    with open(sweep_json, "w", encoding="utf-8") as f:
        json.dump(merged, f, indent=2)
        f.write("\n")
    print(f"sweep: {len(done)} run(s) merged into {sweep_json}", file=sys.stderr)
    if done and not args.no_plots:
        for png in draw(done, args.out):
            print(f"sweep: wrote {png}", file=sys.stderr)
    if failed:
        print(f"bench-sweep: error: {len(failed)} run(s) failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
