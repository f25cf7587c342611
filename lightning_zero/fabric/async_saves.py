"""``FabricSaves``: ``ZeroConfig.async_save`` in a Fabric loop, through the Trainer's background writer
(``AsyncSaver``, Note [asynchronous save] in ``checkpoint/async_save.py``).

Note [asynchronous saves in a Fabric loop]
The writer and its process group are created when the strategy sets up its processes (collective, as at the
Trainer's setup, so that the first save does not stall the step it follows). ``fabric.save`` returns once this rank's
part is staged in host memory; the write and the commit go on in the background and write what a synchronous save
writes. As under the Trainer, at most one save is in flight: the next ``fabric.save``, ``fabric.load`` (and
``load_raw``) and the strategy's ``teardown`` wait for it first and raise its error on every rank (the write's
collectives fail the save on every rank when one rank's write fails).

A Fabric loop usually ends without a call the strategy sees (Fabric calls no ``teardown``), and the writer thread
is a daemon, which the interpreter would stop mid-write: the last checkpoint, often the one that matters, would be
lost without a word. So the process waits for the save in flight as it ends (``compat.at_threading_shutdown``: at a
script's end and at a spawned or forked rank's end), and a save that failed there is printed and makes the process
exit with status 1.
"""

from __future__ import annotations

import os
import sys
import traceback
import weakref
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.checkpoint.async_save import AsyncSaver
from lightning_zero.compat import at_threading_shutdown
from lightning_zero.config import ZeroConfig


class FabricSaves:
    """The strategy's background writer, from its processes' setup to its teardown or the end of the process."""

    def __init__(self) -> None:
        self.saver: AsyncSaver | None = None
        """``ZeroConfig.async_save``: the writer; None otherwise, and after ``finish``."""

    def start(self, config: ZeroConfig, group: dist.ProcessGroup) -> None:
        """Create the writer and its process group, unless there is one. Collective."""
        if not config.async_save or self.saver is not None:
            return
        self.saver = AsyncSaver(timedelta(seconds=config.collective_timeout_s), group)
        owner = weakref.ref(self)
        at_threading_shutdown(lambda: _finish_at_exit(owner))

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error."""
        if self.saver is not None:
            self.saver.wait()

    def finish(self) -> None:
        """Wait for the save in flight, raise its error, and release the writer and its process group."""
        if self.saver is not None:
            saver, self.saver = self.saver, None
            saver.close()


def _finish_at_exit(owner: weakref.ref[FabricSaves]) -> None:
    """The end of the process: commit the save in flight, or fail loudly (Note [asynchronous saves in a Fabric
    loop])."""
    saves = owner()
    if saves is None or saves.saver is None:
        return
    try:
        saves.finish()
    except BaseException:
        print(
            "lightning_zero: the asynchronous checkpoint save still in flight when the process ended failed; that "
            "checkpoint was not committed (the last committed one is intact):",
            file=sys.stderr,
        )
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
