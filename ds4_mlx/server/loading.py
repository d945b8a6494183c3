"""Loading the model without holding up the event loop, the listening port or Ctrl+C."""

import asyncio
import threading


def start_in_background(worker) -> asyncio.Future:
    """Start `worker` (which loads the model) in a daemon thread: a future that settles when the model is
    ready or failed to load. A daemon thread and not the loop's executor, so that leaving during a long
    load does not wait for it to end."""
    loop = asyncio.get_running_loop()
    loaded = loop.create_future()

    def settle(error):
        if not loaded.done():
            loaded.set_result(None) if error is None else loaded.set_exception(error)

    def start():
        try:
            worker.start()
        except Exception as e:  # noqa: BLE001 - handed to whoever awaits the future
            loop.call_soon_threadsafe(settle, e)
        else:
            loop.call_soon_threadsafe(settle, None)

    threading.Thread(target=start, name="ds4-load", daemon=True).start()
    return loaded
