"""`bb-broker flower`: Flower with bb_broker's tabs, refused without a login unless --no-auth says it is local."""

from __future__ import annotations

import click

from bb_broker.cli.common import Command, fail

_NO_AUTH_NOTE = (
    "bb-broker: Flower runs WITHOUT authentication (--no-auth): anyone who can reach {where} sees every task and its "
    "arguments. Its API, and the buttons that use it, answer 401 unless FLOWER_UNAUTHENTICATED_API=true is set, "
    "which also lets any web page your browser opens read it (not change anything: another site's request to do so "
    "is refused). Use --basic-auth=USER:PASSWORD for anything but a private machine."
)


#: Where `bb-broker flower` listens unless told (Flower's own default, "", is every interface, IPv4 and IPv6).
FLOWER_ADDRESS = "127.0.0.1"


@click.command("flower", cls=Command, context_settings={"ignore_unknown_options": True})
@click.option("-A", "--app", "celery_app", required=True, help="The Celery app, as `celery -A` takes it.")
@click.option(
    "--no-auth",
    is_flag=True,
    help="Serve Flower without authentication, for local use; without it Flower must be given --basic-auth, "
    "--auth (OAuth), or their FLOWER_* variables or flowerconfig.py settings.",
)
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
def flower_command(celery_app: str, no_auth: bool, flower_args: tuple[str, ...]) -> None:
    """Run Flower (`celery -A APP flower FLOWER_ARGS...`) with a Broker tab showing each queue's jobs.

    Flower must authenticate its users (--basic-auth=USER:PASSWORD, or --auth with an OAuth provider), unless
    --no-auth says it is for local use. It listens on 127.0.0.1 unless --address (FLOWER_ADDRESS, flowerconfig.py's
    address) says where: --address=0.0.0.0 for every interface.
    """
    try:
        from bb_broker.contrib.flower import broker as adapter  # importing the plugin installs its tabs into Flower
        from bb_broker.contrib.flower import hosts
    except ImportError as exc:
        fail(f"Flower is not installed ({exc}): pip install 'bb-broker[flower]'")
    from tornado.options import Error as FlowerOptionError

    try:
        scheme = adapter.authentication(flower_args)
    except (FlowerOptionError, ValueError, OSError) as exc:  # a bad value, or a --conf file that is not there
        fail(f"flower: {exc}", 2)
    if scheme is None and not no_auth:
        fail(
            "flower: refusing to serve Flower without authentication. Pass --basic-auth=USER:PASSWORD "
            "(or set FLOWER_BASIC_AUTH), or --auth=EMAIL_REGEX with an OAuth provider (FLOWER_AUTH, "
            "FLOWER_OAUTH2_KEY/SECRET/REDIRECT_URI), or set basic_auth/auth in flowerconfig.py; "
            "--no-auth serves it to anyone who can reach it, for local use only.",
            2,
        )
    if scheme is not None and no_auth:
        fail(f"flower: --no-auth contradicts the {scheme} authentication Flower is configured with", 2)
    from tornado.options import options  # as authentication() left them: Flower's environment, file and arguments

    try:
        hosts.check_allowed_hosts(options.allowed_hosts)
    except ValueError as exc:
        fail(f"flower: {exc}", 2)
    if not options.unix_socket and not 1 <= options.port <= 65535:  # else a traceback from the socket's bind
        fail(f"flower: --port {options.port} is no port: give one from 1 to 65535", 2)
    if not options.address and not options.unix_socket:
        flower_args = (*flower_args, f"--address={FLOWER_ADDRESS}")  # the arguments Flower reads last
    if no_auth:
        click.echo(_NO_AUTH_NOTE.format(where=f"{options.address or FLOWER_ADDRESS}:{options.port}"), err=True)
    from celery.bin.celery import celery

    celery.main(args=["-A", celery_app, "flower", *flower_args], prog_name="celery", auto_envvar_prefix="CELERY")
