"""An ordered process pool that can always be stopped at once, and whose workers never outlive their parent.

Each worker has its own task pipe and result pipe; task ``k`` goes to worker ``k mod N`` and results are read
back in task order, so no lock or queue is shared between processes. Stopping is therefore always safe: on an
error or an interrupt the workers are killed and joined, and nothing can be left holding a lock that the
parent then waits on (the way a ``concurrent.futures`` pool can hang after a worker dies mid-write).

A worker reads its task pipe on a thread. The parent holds the only write end of it, so when the parent exits
for any reason, SIGKILL included, that thread sees end-of-file and ends the worker at once. Workers ignore
SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the parent alone decides what to do.

Owns: starting, feeding, draining and stopping worker processes.
Not responsible for: what the tasks compute (``offline_encoding``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

__all__ = ["OrderedWorkerPool", "WorkerPoolError"]

_JOIN_SECONDS = 5.0


class WorkerPoolError(RuntimeError):
    """A worker process died without answering (killed, or out of memory)."""


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    tasks: object  # Connection, parent's write end
    results: object  # Connection, parent's read end


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT while workers start: they inherit the mask and ignore SIGINT before unblocking it."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _read_tasks(connection, tasks: queue.SimpleQueue) -> None:
    try:
        while True:
            tasks.put(connection.recv())
    except (EOFError, OSError):
        os._exit(0)  # the parent closed the pipe (done) or died: stop now, whatever the worker is doing


def _failure(error: BaseException) -> tuple:
    return ("error", error, "".join(traceback.format_exception(error)))


def _worker_main(task_connection, result_connection, initializer, initargs, function) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    tasks: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_tasks, args=(task_connection, tasks), daemon=True).start()
    try:
        if initializer is not None:
            initializer(*initargs)
        failed = None
    except Exception as error:
        failed = _failure(error)
    while True:
        task = tasks.get()
        if failed is not None:
            reply = failed
        else:
            try:
                reply = ("ok", function(task))
            except Exception as error:
                reply = _failure(error)
        try:
            result_connection.send(reply)
        except (BrokenPipeError, ConnectionResetError):
            os._exit(0)  # the parent is gone
        except Exception as error:  # a result or an exception that cannot be pickled
            result_connection.send(("error", RuntimeError(repr(error)), traceback.format_exc()))


class OrderedWorkerPool:
    """``workers`` processes applying ``function`` to tasks, results yielded in task order.

    Use as a context manager: leaving the block normally lets the workers exit; leaving it with an exception
    (including ``KeyboardInterrupt``) kills them. Either way every worker is joined before the block ends.

    Args:
        workers: number of processes (``spawn`` start method: forking after tokenizer threads start can deadlock).
        function: a picklable function of one task, run in the workers.
        initializer: run once in each worker before its first task, with ``initargs``.
        in_flight_per_worker: tasks handed out ahead of the one being collected, per worker (bounds memory).
    """

    def __init__(
        self,
        workers: int,
        function: Callable,
        initializer: Callable | None = None,
        initargs: tuple = (),
        in_flight_per_worker: int = 2,
    ) -> None:
        self.window = max(1, workers * in_flight_per_worker)
        self._workers: list[_Worker] = []
        context = multiprocessing.get_context("spawn")
        try:
            with _sigint_blocked():
                for number in range(workers):
                    self._workers.append(self._start(context, number, function, initializer, initargs))
        except BaseException:
            self.kill()
            raise

    @staticmethod
    def _start(context, number: int, function, initializer, initargs) -> _Worker:
        task_reader, task_writer = context.Pipe(duplex=False)
        result_reader, result_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_worker_main,
            args=(task_reader, result_writer, initializer, initargs, function),
            name=f"hp-data-worker-{number}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            # The worker's ends live in the worker only: end-of-file must mean that the other side is gone.
            task_reader.close()
            result_writer.close()
        return _Worker(process, task_writer, result_reader)

    def imap(self, tasks: Iterable) -> Iterator[tuple]:
        """Apply the function to every task; yields ``(task, result)`` in task order, at most ``window`` ahead."""
        pending: deque[tuple[_Worker, object]] = deque()
        turn = 0
        for task in tasks:
            worker = self._workers[turn]
            turn = (turn + 1) % len(self._workers)
            self._send(worker, task)
            pending.append((worker, task))
            if len(pending) >= self.window:
                worker, task = pending.popleft()
                yield task, self._receive(worker)
        while pending:
            worker, task = pending.popleft()
            yield task, self._receive(worker)

    def _send(self, worker: _Worker, task) -> None:
        try:
            worker.tasks.send(task)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(worker) from None

    def _receive(self, worker: _Worker):
        try:
            reply = worker.results.recv()
        except (EOFError, ConnectionResetError):
            raise self._died(worker) from None
        if reply[0] == "ok":
            return reply[1]
        _, error, remote_traceback = reply
        error.add_note(f"raised in worker process {worker.process.pid}:\n{remote_traceback}")
        raise error

    @staticmethod
    def _died(worker: _Worker) -> WorkerPoolError:
        worker.process.join(_JOIN_SECONDS)
        return WorkerPoolError(
            f"worker process {worker.process.pid} exited with code {worker.process.exitcode} before answering "
            "(killed, or out of memory?); run again, with fewer --workers or a smaller --chunk-size if memory is short"
        )

    def close(self) -> None:
        """Let the workers exit (they stop when their task pipe closes) and join them; kill any that linger."""
        for worker in self._workers:
            worker.tasks.close()
        self._join()

    def kill(self) -> None:
        """Kill every worker now and join them."""
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.tasks.close()
        self._join()

    def _join(self) -> None:
        for worker in self._workers:
            worker.process.join(_JOIN_SECONDS)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.results.close()
            worker.process.close()
        self._workers = []

    def __enter__(self) -> OrderedWorkerPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()
