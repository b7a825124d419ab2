"""What a failed Hub download says: where a repo could not be reached (no network, the Hub down, offline mode with
nothing in the cache), the one sentence that names the repo and the three ways on: HF_HUB_OFFLINE with a cached
copy, a local path, or `decodekit download` where there is a network. huggingface_hub's own errors for a repo that
does not exist, is gated, or has no such revision pass unchanged: they already say so."""

from __future__ import annotations

import contextlib


class HubUnreachable(OSError):
    """A Hub repo could not be fetched: no network, or offline mode without a cached copy."""


def unreachable(error: BaseException) -> bool:
    """Whether `error` says the Hub could not be reached (no network, offline mode without a cached copy)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    if isinstance(error, LocalEntryNotFoundError):
        return True
    names = {cls.__name__ for cls in type(error).__mro__}
    # httpx's and requests' connection failures, by name: decodekit imports neither
    return bool(
        names
        & {
            "ConnectError",
            "ConnectTimeout",
            "ConnectionError",
            "NetworkError",
            "ReadTimeout",
            "TimeoutException",
            "ProxyError",
        }
    )


@contextlib.contextmanager
def hub_download(repo_id: str, what: str = "model", downloading: bool = False):
    """Re-raises an unreachable Hub, inside the block, as HubUnreachable naming `repo_id` and what to do;
    `downloading`: the block is `decodekit download` itself, which is then not offered as the way on."""
    try:
        yield
    except Exception as error:
        if not unreachable(error):
            raise
        flag = "--method " if what == "method" else ""
        local = "a local directory" if what == "method" else "a local directory (or .gguf file)"
        if downloading:
            way_on = (
                "Run this again where the Hub can be reached (check the network, a proxy's HTTPS_PROXY, or "
                "HF_ENDPOINT for a mirror); HF_HUB_OFFLINE=1 must not be set while it downloads."
            )
        else:
            way_on = (
                f"Offline: give {local} instead, or fetch it first where there is a network with "
                f"`decodekit download {flag}{repo_id}`; HF_HUB_OFFLINE=1 then reads the cached copy without asking "
                "the Hub."
            )
        raise HubUnreachable(
            f"could not fetch the {what} {repo_id!r} from the Hub ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no answer'}), and it is not in the local cache. {way_on}"
        ) from None
