"""Placeholder entry point, replaced by the typer app."""
def main() -> None:  # pragma: no cover
    raise SystemExit("ragen: CLI not built yet")
