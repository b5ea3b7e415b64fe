"""`openalice-scheduler`: run the service (`serve`)."""

from __future__ import annotations

import typer
from pydantic import ValidationError

app = typer.Typer(
    name="openalice-scheduler",
    help="GPU/compute lease service for renderer and anim workers.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """GPU/compute lease service for renderer and anim workers."""


@app.command()
def serve() -> None:
    """Run the service. Configured only by environment variables (see README)."""
    import uvicorn

    from openalice_scheduler.app import StartupError, create_app
    from openalice_scheduler.config import Settings, describe_validation_error
    from openalice_scheduler.logs import configure_logging
    from openalice_scheduler.providers import ProviderConfigError

    try:
        settings = Settings()  # type: ignore[call-arg]  # from the environment
    except ValidationError as exc:
        _die(describe_validation_error(exc))
    configure_logging(settings.log_filter, settings.secrets())
    try:
        application = create_app(settings)
    except (ProviderConfigError, ValueError) as exc:
        _die(f"invalid configuration: {exc}")
    except StartupError as exc:
        # create_app takes the SQLite file lock itself (before serving), so a second
        # process on the same file fails here: one line, not a traceback.
        _die(str(exc))
    try:
        uvicorn.run(
            application,
            host=settings.scheduler_host,
            port=settings.scheduler_port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=15,
        )
    except StartupError as exc:
        _die(str(exc))


def _die(message: str) -> None:
    typer.echo(f"openalice-scheduler: {message}", err=True)
    raise SystemExit(2)


def main() -> None:
    app(prog_name="openalice-scheduler")


if __name__ == "__main__":
    main()
