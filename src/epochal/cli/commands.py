"""The click commands of ``epochal``; tables and colours through rich.

Every read-only command takes ``--json`` (one JSON document on stdout, for scripts). Exit
codes: 0 ok, 1 a problem was found (damaged file, not a checkpoint, unknown blob, ...),
2 a usage error. Errors are one line on stderr.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from .. import knobs
from .common import (
    CONTEXT,
    FileArg,
    Out,
    PathArg,
    PrefixArg,
    _out,
    db_type_option,
    fmt_num,
    held_line,
    human_bytes,
    human_seconds,
    json_option,
    parse_storage_options,
    stats_rows,
    storage_options_option,
)
from .dbs import inspect_blob, inspect_db
from .diff import diff_dbs
from .export import export_db
from .hf_dirs import hf_db
from .names import RECORDS_DIR
from .problems import Problem
from .records import LS_NEWEST, ls_prefix, stats_prefix, verify_target


# ------------------------------------------------------------------ the group
@click.group(context_settings=CONTEXT)
@click.version_option(package_name="epochal", prog_name="epochal", message="%(prog)s %(version)s")
@click.option("-q", "--quiet", is_flag=True, help="No progress display (same as EPOCHAL_QUIET=1).")
@click.option("-v", "--verbose", count=True, help="Log to stderr (-v info, -vv debug).")
@click.option("--color/--no-color", default=None, help="Force colours on or off (default: on a terminal; NO_COLOR is honoured).")
@click.pass_context
def cli(ctx: click.Context, quiet: bool, verbose: int, color: bool | None) -> None:
    """epochal: epoch-by-epoch training jobs with crash-safe, checksummed checkpoints.

    Look at a directory of checkpoints (a job's db_prefix, one file per node and epoch named
    NODE.EPOCH) without writing code. Exit codes: 0 ok, 1 problem found, 2 usage error.
    """
    ctx.obj = Out(color, quiet=quiet)
    if verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("epochal").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


# ------------------------------------------------------------------ ls
STATE_STYLE = {"final": "bold green", "committed": "green", "uncommitted": "yellow",
               "missing files": "bold red", "unknown": "dim"}


@cli.command("ls", context_settings=CONTEXT)
@click.argument("prefix", type=PrefixArg)
@click.option("--all", "show_all", is_flag=True, help=f"Every epoch (default: the newest {LS_NEWEST}).")
@storage_options_option
@json_option
@click.pass_context
def ls_cmd(ctx: click.Context, prefix: str, show_all: bool, as_json: bool) -> int:
    """Epochs x nodes under PREFIX: committed or not, sizes, timestamps, retention pins.

    An epoch is committed once every node's db was saved and the metadata handler recorded it;
    other db files (a save that was cut short, or written without records) are listed too.
    The newest 20 epochs are shown (only their records are read); --all shows every one.
    """
    out = _out(ctx)
    listing, best = ls_prefix(prefix, None if show_all else LS_NEWEST)
    ranks = {e: i + 1 for i, e in enumerate(best.epochs)} if best is not None else {}
    for e in listing["epochs"]:
        e["best"] = ranks.get(e["epoch"])
    if as_json:
        out.json(listing)
        return 0
    held = held_line(prefix, listing.get("held"))  # (a local tier: the host memory it holds)
    if not listing["epochs"]:
        out.console.print(f"no checkpoints under {prefix}" + (f"\n{held}" if held else ""), soft_wrap=True)
        return 0
    nodes: list[str] = listing["nodes"]
    table = Table(title=f"checkpoints in {prefix}", title_justify="left")
    table.add_column("epoch", justify="right")
    table.add_column("state")
    table.add_column("created")
    table.add_column("size", justify="right")
    table.add_column("pin")
    if best is not None:
        table.add_column(f"best ({best.mode} {best.metric})")
    wide = len(nodes) <= 6
    if wide:
        for n in nodes:
            table.add_column(n, justify="right", overflow="fold")
    else:
        table.add_column("nodes", justify="right")
    for e in listing["epochs"]:
        row: list[Any] = [str(e["epoch"]), Text(e["state"], style=STATE_STYLE.get(e["state"], "")),
                          (e["created"] or "-").replace("T", " "), human_bytes(e["size"]),
                          "pinned" if e["pinned"] else ""]
        if best is not None:
            value = best.values.get(e["epoch"])
            rank = f"#{e['best']} " if e["best"] else ""
            shown = "unreadable" if e["epoch"] in best.unreadable else "-" if value is None else f"{value:.6g}"
            row.append(Text(f"{rank}{shown}", style="bold" if e["best"] else "dim"))
        if wide:
            for n in nodes:
                f = e["files"].get(n)
                if f is None:
                    row.append(Text("-", style="dim"))
                elif not f["present"]:
                    row.append(Text("missing", style="bold red"))
                else:
                    row.append(human_bytes(f["size"]))
        else:
            have = sum(1 for f in e["files"].values() if f["present"])
            row.append(f"{have}/{len(nodes)}")
        table.add_row(*row)
    out.console.print(table)
    if held:
        out.console.print(held, soft_wrap=True)
    if listing.get("older"):
        out.note(f"{listing['older']} older epoch(s) not shown: epochal ls --all {prefix} lists every one")
    if not listing["records"]:
        out.note(f"note: {prefix} has no {RECORDS_DIR}/ records (written without "
                 "DirectoryMetadataHandler): commit state unknown")
    return 0


# ------------------------------------------------------------------ inspect
@cli.command("inspect", context_settings=CONTEXT)
@click.argument("db", type=FileArg)
@click.option("--blob", "blob", default=None, metavar="NAME", help="Summary statistics of this blob's values.")
@storage_options_option
@db_type_option
@json_option
@click.pass_context
def inspect_cmd(ctx: click.Context, db: str, blob: str | None, db_type: str | None, as_json: bool) -> int:
    """The blobs of one checkpoint file DB: name, kind, dtype, shape, bytes, checksum.

    Only the file's index is read. With --blob NAME, that blob is read (its checksum
    verified) and summarised: min, max, mean, std, NaN/inf/zero counts (per leaf for state
    dicts and other containers).
    """
    out = _out(ctx)
    db = hf_db(db)  # a Hugging Face checkpoint folder: its db
    if blob is not None:
        info = inspect_blob(db, blob, db_type)
        if as_json:
            out.json(info)
            return 0
        _print_blob(out, info)
        return 0
    info = inspect_db(db, db_type)
    if as_json:
        out.json(info)
        return 0
    head = f"{db}  [{info['db_type']}"
    if info.get("format_version"):
        head += f" {info['format_version']}, {info['checksum_algorithm']}"
    head += f"]  {info['blob_count']} blobs, {human_bytes(info['data_bytes'])} of data, " \
            f"{human_bytes(info['file_bytes'])} on disk"
    out.console.print(Text(head, style="bold"))
    table = Table()
    for col, kw in (("name", {"overflow": "fold"}), ("kind", {}), ("dtype", {"overflow": "fold"}),
                    ("shape", {}), ("bytes", {"justify": "right"}), ("checksum", {"overflow": "fold"})):
        table.add_column(col, **kw)  # type: ignore[arg-type]
    for b in info["blobs"]:
        shape = "x".join(str(d) for d in b["shape"]) if b["shape"] is not None else "-"
        if b["shape"] == []:
            shape = "()"
        table.add_row(b["name"], b["kind"], b["dtype"] or "-", shape, human_bytes(b["nbytes"]),
                      Text(b["checksum"] or "-", style="dim"))
    out.console.print(table)
    return 0


def _print_blob(out: Out, info: dict[str, Any]) -> None:
    b = info["blob"]
    out.console.print(Text(f"{info['path']}  blob {b['name']!r}  ({b['kind']}, {human_bytes(b['nbytes'])})", style="bold"))
    stats = b["stats"]
    table = Table(show_header=False)
    table.add_column("stat")
    table.add_column("value", overflow="fold")
    for k, v in stats_rows(stats):
        table.add_row(k, v)
    out.console.print(table)
    leaves = stats.get("leaves")
    if leaves:
        lt = Table(title=f"{stats['leaf_count']} leaves", title_justify="left")
        for col in ("key", "type", "dtype", "shape", "min", "max", "mean", "std", "nan/inf", "value"):
            lt.add_column(col, overflow="fold")
        for leaf in leaves:
            shape = leaf.get("shape")
            bad = f"{leaf['nan']}/{leaf['inf']}" if "nan" in leaf else ""
            value = leaf.get("value", leaf.get("sample", ""))
            lt.add_row(leaf["key"], leaf.get("type", ""), leaf.get("dtype", "") or "",
                       "x".join(map(str, shape)) if shape else ("()" if shape == [] else ""),
                       *[fmt_num(leaf[k]) if k in leaf else "" for k in ("min", "max", "mean", "std")],
                       bad, "" if value == "" else json.dumps(value))
        out.console.print(lt)


# ------------------------------------------------------------------ verify
@cli.command("verify", context_settings=CONTEXT)
@click.argument("target", metavar="PREFIX|DB", type=PathArg)
@storage_options_option
@db_type_option
@json_option
@click.pass_context
def verify_cmd(ctx: click.Context, target: str, db_type: str | None, as_json: bool) -> int:
    """Re-check every checksum of a checkpoint file, or of every db file under PREFIX.

    Names each damaged file and blob, and (with directory records) every committed epoch whose
    files are missing or differ from what was recorded. Exit code 1 when anything is damaged.
    """
    out = _out(ctx)
    result = verify_target(target, db_type)
    if as_json:
        out.json(result)
        return 0 if result["ok"] else 1
    for f in result["files"]:
        label = f["path"]
        if f["ok"]:
            out.console.print(Text.assemble(("ok      ", "green"), label, (f"  ({f.get('blobs', '?')} blobs)", "dim")))
            continue
        for p in f["problems"]:
            where = f", blob {p['blob']!r}" if p.get("blob") is not None else ""
            out.console.print(Text.assemble(("DAMAGED ", "bold red"), f"{label}{where}: {p['message']}"))
    for e in result["epochs"]:
        if "folder" in e and e["ok"]:  # a Hugging Face checkpoint folder, every recorded file checked
            out.console.print(Text.assemble(("ok      ", "green"), e["folder"]))
        for p in e["problems"]:
            out.console.print(Text.assemble(("PROBLEM ", "bold red"), f"epoch {e['epoch']}: {p}"))
    nbad = sum(1 for f in result["files"] if not f["ok"])
    nepoch_bad = sum(1 for e in result["epochs"] if not e["ok"])
    if not result["files"] and not result["epochs"]:
        out.console.print(f"no checkpoints under {target}")
    elif result["ok"]:
        out.console.print(Text(f"all {len(result['files'])} db file(s) intact", style="bold green"))
    else:
        msg = f"{nbad} damaged db file(s)" + (f", {nepoch_bad} epoch(s) with record problems" if nepoch_bad else "")
        out.console.print(Text(msg, style="bold red"))
    return 0 if result["ok"] else 1


# ------------------------------------------------------------------ diff
@cli.command("diff", context_settings=CONTEXT)
@click.argument("db1", type=FileArg)
@click.argument("db2", type=FileArg)
@click.option("--exit-code", is_flag=True, help="Exit with 1 when the checkpoints differ (like git diff --exit-code).")
@storage_options_option
@db_type_option
@json_option
@click.pass_context
def diff_cmd(ctx: click.Context, db1: str, db2: str, exit_code: bool, db_type: str | None, as_json: bool) -> int:
    """Blobs added, removed and changed from DB1 to DB2, with the max abs difference.

    Blobs with equal checksums are not read. Exit code 0 whether they differ or not, unless
    --exit-code.
    """
    out = _out(ctx)
    result = diff_dbs(db1, db2, db_type)
    code = 1 if exit_code and not result["identical"] else 0
    if as_json:
        out.json(result)
        return code
    out.console.print(Text(f"--- {db1}\n+++ {db2}", style="bold"))
    if result["identical"]:
        out.console.print(f"identical ({result['unchanged']} blobs)")
        return code
    table = Table()
    table.add_column("", width=1)
    table.add_column("blob", overflow="fold")
    table.add_column("change", overflow="fold")
    table.add_column("max abs diff", justify="right")
    for b in result["added"]:
        table.add_row(Text("+", style="green"), b["name"], f"added ({b['kind']} {b['dtype'] or ''} {b['shape']})", "")
    for b in result["removed"]:
        table.add_row(Text("-", style="red"), b["name"], f"removed ({b['kind']} {b['dtype'] or ''} {b['shape']})", "")
    for c in result["changed"]:
        what = []
        for field in ("kind", "dtype", "shape"):
            if c[field][0] != c[field][1]:
                what.append(f"{field} {c[field][0]} -> {c[field][1]}")
        if not what:
            what = [", ".join(c["changes"])]
        leaves = c.get("leaves") or []
        if leaves:
            what.append(f"{len(leaves)} leaf/leaves: " + ", ".join(
                f"{leaf['key']}" + (f" ({leaf['reason']})" if leaf.get("reason") else "") for leaf in leaves[:8]
            ) + (", ..." if len(leaves) > 8 else ""))
        table.add_row(Text("~", style="yellow"), c["name"], "; ".join(what), fmt_num(c.get("max_abs_diff")))
    out.console.print(table)
    out.console.print(f"{len(result['added'])} added, {len(result['removed'])} removed, "
                      f"{len(result['changed'])} changed, {result['unchanged']} unchanged")
    return code


# ------------------------------------------------------------------ stats
@cli.command("stats", context_settings=CONTEXT)
@click.argument("prefix", type=PrefixArg)
@storage_options_option
@click.option("--plot", "plot", type=click.Path(dir_okay=False, writable=True), default=None, metavar="FILE.png",
              help="Also draw durations and throughput per node and epoch into FILE.png (needs matplotlib).")
@click.option("--all", "show_all", is_flag=True, help="One row per record (default: a summary plus the last 20 records).")
@json_option
@click.pass_context
def stats_cmd(ctx: click.Context, prefix: str, plot: str | None, show_all: bool, as_json: bool) -> int:
    """Save/load durations and throughput per node and epoch, from PREFIX's stats log.

    The log is written by DirectoryMetadataHandler (PREFIX/.epochal/). Exit code 1 when there
    is none.
    """
    out = _out(ctx)
    result = stats_prefix(prefix)
    if not result["records"]:
        raise Problem(f"{prefix}: no save/load stats recorded (the log in {RECORDS_DIR}/ is written by DirectoryMetadataHandler)")
    if plot:
        from .plot import plot_stats

        plot_stats(result, plot)
        result["plot"] = plot
    if as_json:
        out.json(result)
        return 0
    summary = Table(title=f"checkpoint I/O in {prefix}", title_justify="left")
    for col in ("action", "node", "count", "mean", "max", "total", "throughput"):
        summary.add_column(col, justify="left" if col in ("action", "node") else "right")
    for s in result["summary"]:
        summary.add_row(s["action"], s["node"], str(s["count"]), human_seconds(s["mean_seconds"]),
                        human_seconds(s["max_seconds"]), human_bytes(s["total_bytes"]),
                        f"{s['mb_per_s']:.1f} MB/s" if s["mb_per_s"] else "-")
    out.console.print(summary)
    rows = result["records"] if show_all else result["records"][-20:]
    table = Table(title=("all records" if show_all or len(rows) == len(result["records"])
                         else f"last {len(rows)} of {len(result['records'])} records"), title_justify="left")
    for col in ("time", "action", "epoch", "node", "seconds", "size", "throughput"):
        table.add_column(col, justify="right" if col in ("epoch", "seconds", "size", "throughput") else "left")
    for r in rows:
        table.add_row(str(r["time"] or "-").replace("T", " "), r["action"], str(r["epoch"]), str(r["node"]),
                      human_seconds(r["seconds"]), human_bytes(r["bytes"]),
                      f"{r['mb_per_s']:.1f} MB/s" if r["mb_per_s"] else "-")
    out.console.print(table)
    if plot:
        out.console.print(f"plot written to {plot}")
    return 0


# ------------------------------------------------------------------ export
@cli.command("export", context_settings=CONTEXT)
@click.argument("db", type=FileArg)
@click.option("--to", "fmt", type=click.Choice(["safetensors", "npz"]), required=True, help="The output format.")
@click.argument("out_path", metavar="OUT", type=click.Path(dir_okay=False, writable=True))
@click.option("--blob", "blob", default=None, metavar="NAME",
              help="With --to safetensors: write only this blob's state dict under its own keys "
                   "(a model: safetensors.torch.load_model reads it). DB may then be a directory.")
@db_type_option
@json_option
@click.pass_context
def export_cmd(ctx: click.Context, db: str, fmt: str, out_path: str, blob: str | None, db_type: str | None,
               as_json: bool) -> int:
    """Write the arrays of checkpoint DB to OUT as safetensors or npz, for other tools.

    Every checksum is verified first. Python and numpy scalars become 0-d arrays; the leaves
    of state dicts and other containers become BLOB/KEY entries; values the format cannot
    hold (strings for safetensors, None, ...) are skipped and listed. With ``--blob``, one
    state dict is written under its own key names and dtypes, shared tensors once (DB: a db,
    or a checkpoint directory for its newest committed epoch).
    """
    out = _out(ctx)
    if blob is not None:
        if fmt != "safetensors":
            raise click.UsageError("--blob goes with --to safetensors")
        from ..integrations.safetensors_export import export_safetensors

        try:
            keys = export_safetensors(db, blob, out_path)
        except ImportError as ex:
            raise Problem(str(ex)) from None
        if as_json:
            out.json({"out": out_path, "blob": blob, "written": keys})
        else:
            out.console.print(f"wrote {len(keys)} tensor(s) of blob {blob!r} to {out_path} (safetensors)")
        return 0
    if os.path.isdir(db):
        raise Problem(f"{db} is a directory: name one db file (or pass --blob to export a state dict)")
    result = export_db(db, fmt, out_path, db_type)
    if as_json:
        out.json(result)
        return 0
    out.console.print(f"wrote {len(result['written'])} array(s) to {result['out']} "
                      f"({fmt}, {human_bytes(result['bytes'])})")
    for note in result["notes"]:
        out.note(f"note: {note}")
    for s in result["skipped"]:
        out.note(f"skipped {s['name']}: {s['reason']}")
    return 0


# ------------------------------------------------------------------ pull
@cli.command("pull", context_settings=CONTEXT)
@click.argument("url")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--epoch", type=int, default=None, help="This epoch (default: the newest one that verifies).")
@click.option("-o", "--option", "options", multiple=True, metavar="KEY=VALUE",
              help="An fsspec storage option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000.")
@json_option
@click.pass_context
def pull_cmd(ctx: click.Context, url: str, directory: str, epoch: int | None,
             options: tuple[str, ...], as_json: bool) -> int:
    """Restore a committed epoch from a mirror URL (``DirectoryMetadataHandler(mirror=URL)``)
    into DIRECTORY, verified, as a committed local checkpoint.

    Every db is downloaded to a temp name, checked against the remote manifest (size, digest)
    and checksum by checksum, then renamed into place; the manifest comes last. Without
    --epoch the newest remote epoch that verifies is taken (damaged ones are skipped, with a
    note). Needs the s3 extra for s3:// (fsspec, s3fs).
    """
    from ..checkpoint.mirroring.mirror import RemoteMirror
    from ..errors import CheckpointError

    out = _out(ctx)
    try:  # fsspec says ValueError for an unknown scheme, ImportError for a missing package
        mirror = RemoteMirror(url, parse_storage_options(options))
        epochs = [epoch] if epoch is not None else list(reversed(mirror.epochs()))
    except (ValueError, ImportError) as ex:
        raise Problem(f"{url}: cannot open the mirror: {ex}") from None
    if not epochs:
        raise Problem(f"no committed epoch at {url}")
    records = os.path.join(directory, RECORDS_DIR)
    last_error: Exception | None = None
    for e in epochs:
        try:
            got = mirror.pull(directory, records, e, None, None)
        except CheckpointError as ex:
            last_error = ex
            if epoch is None:
                out.note(f"skipped epoch {e}: {ex}")
            continue
        files = sorted(n.file for n in got.nodes.values())
        size = got.size
        if as_json:
            out.json({"url": url, "epoch": e, "directory": directory, "files": files, "bytes": size,
                      "final": got.final})
        else:
            out.console.print(f"restored epoch {e} from {url} into {directory}: "
                              f"{len(files)} db(s), {human_bytes(size)}, verified")
        return 0
    assert last_error is not None
    raise last_error


# ------------------------------------------------------------------ demo
@cli.command("demo", context_settings=CONTEXT)
@click.option("--dir", "directory", default="./checkpoints", show_default=True,
              type=click.Path(file_okay=False), help="Where the demo job keeps its checkpoints.")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="Epochs to train (default: the demo's own).")
@click.option("--more", type=click.IntRange(min=1), default=None,
              help="Train this many epochs past the newest committed one (each run continues the job).")
@click.option("--points", type=click.IntRange(min=300), default=None,
              help="Training points per epoch, chosen when the job starts (default 500,000; fewer: faster epochs).")
@click.option("--quiet", is_flag=True, help="No progress display.")
@click.pass_context
def demo_cmd(ctx: click.Context, directory: str, epochs: int | None, more: int | None, points: int | None, quiet: bool) -> int:
    """Train a small numpy MLP as an epochal Job, checkpointing every epoch into --dir.

    Run it again (or interrupt it with Ctrl-C and rerun) and it resumes from the last
    committed epoch. Then try: epochal ls DIR, epochal verify DIR, epochal stats DIR.
    """
    try:
        from ..demo import run_demo
    except ImportError as e:
        raise Problem(f"the demo is not available in this installation: {e}") from None
    given = {"epochs": epochs, "more": more, "points": points}
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    kwargs["quiet"] = quiet or _out(ctx).quiet or knobs.is_quiet()
    from ..errors import Preempted

    try:
        run_demo(directory, **kwargs)  # returns the last epoch run, not an exit code
    except Preempted as ex:  # the demo already said which epoch is committed
        return ex.exit_code  # 130 after Ctrl-C, 143 after SIGTERM: a scheduler reruns it
    return 0
