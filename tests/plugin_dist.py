"""Register plug-ins for a test as a real installed distribution would: a module and a `*.dist-info` folder (METADATA
and entry_points.txt) in a folder that goes on sys.path (or on a worker's PYTHONPATH), which
importlib.metadata.entry_points then finds as it finds any installed package's."""

from __future__ import annotations

from pathlib import Path


def install(site: Path, dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str] | None = None,
            ) -> Path:
    """Write distribution `dist` into `site`: its `modules` ({module name: source}) and its `entry_points`
    ({group: {name: "module:function"}}); returns `site`."""
    site.mkdir(parents=True, exist_ok=True)
    for name, source in (modules or {}).items():
        (site / f"{name}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in names.items()) + "\n"
        for group, names in entry_points.items()))
    return site
