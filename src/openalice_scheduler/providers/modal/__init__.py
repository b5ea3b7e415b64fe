"""Workers on Modal: a lease is a Modal Sandbox (provider.py)."""

from openalice_scheduler.providers.modal.provider import ModalProvider

__all__ = ["ModalProvider"]
