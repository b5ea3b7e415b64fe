"""A Modal emulator: a local gRPC server the official `modal` client (1.6.4) talks to,
whose sandboxes are real Docker containers with real TLS tunnels, for the Modal
provider's tests.

    with ModalEmulator(network="oa-modal") as modal:
        os.environ.update(modal.client_env())
        ...  # modal.App.lookup(...), modal.Sandbox.create(...), the scheduler, ...

See README.md beside this file for what is emulated, what is recorded and the switches.
"""

from .containers import LABEL_APP, LABEL_INSTANCE, LABEL_SANDBOX
from .handle import ModalEmulator
from .version import CHECKED_CLIENT_VERSION

__all__ = [
    "CHECKED_CLIENT_VERSION",
    "LABEL_APP",
    "LABEL_INSTANCE",
    "LABEL_SANDBOX",
    "ModalEmulator",
]
