"""``minedraft up``: start verifier, drafter, coordinator and gateway as local processes (torch-free).

Start-up: resolve the target model dir once (``python -m specdec.models.loader resolve``), start every
service on loopback with its log in ``runs/<timestamp>/<service>.log``, pin verifier and drafter
to their own core with one torch thread each (DESIGN.md §8: the PSD overlap exists only if each
engine owns a core), and wait until each reports SERVING on grpc.health.v1. A child that dies
during start-up has its log tail printed and the launch fails (``StackError``) after every
other child is stopped. After start-up a dead drafter or coordinator is restarted on its port
(``restart_exited``): meanwhile the coordinator serves on the verifier alone (``ar`` fallback,
coordinator.fallback) or the gateway answers UNAVAILABLE, and both re-sync when it is back. The
restart budget is for crash loops, not a lifetime: at most ``MAX_RESTARTS`` restarts in a row, and
a service that then stays up ``STABLE_S`` gets its full budget back (like Kubernetes' crash-loop
back-off reset). A drafter out of restarts stays down (a warning says so) and the stack keeps
serving without speculation; a coordinator out of restarts, or a dead verifier or gateway, ends
``minedraft up`` (the verifier holds every request's KV cache). Shutdown (Ctrl-C / SIGTERM /
such a death): ``Stack.stop`` drains front to back (gateway, coordinator, engines). Children
also get PR_SET_PDEATHSIG, so they are killed if the launcher itself is killed: no orphans.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

from grpc_health.v1 import health_pb2

from minedraft.child_exec import NO_CPUS
from minedraft.probes import NUM_LOG_TAIL_LINES, health_status, log_tail  # noqa: F401  (part of the launcher API)
from minedraft.banner import banner_lines  # noqa: F401  (part of the launcher API)
from minedraft.capacity import check_memory
from minedraft.cuda_mps import CudaMpsDaemon
from minedraft.stack import ServiceSpec, StackConfig, build_service_specs, coordinator_spec

POLL_S = 0.25
RESTARTABLE = ("drafter", "coordinator")  # their state is rebuilt after a restart (see the module docstring)
OPTIONAL = ("drafter",)  # the stack serves without it (``ar`` fallback) once it is out of restarts
MAX_RESTARTS = 5  # per service, in a row (see STABLE_S)
STABLE_S = 600.0  # a service up this long since its (re)start has its restart count reset


class StackError(RuntimeError):
    """A service failed to start or died."""


def start_groups(cfg: StackConfig, specs: list[ServiceSpec]) -> list[list[ServiceSpec]]:
    """``specs`` (``build_service_specs``' order: verifier, drafter if any, coordinator, gateway)
    as the groups ``Stack.start`` starts in turn, each SERVING before the next starts.

    The native engines start with the rest at once. vLLM engines start before the coordinator and
    gateway; beside each other, except where they share a GPU (``Placement.is_shared_gpu``): vLLM
    sizes its KV cache from the GPU memory it sees free (``gpu_memory_utilization``), so the one
    starting second must see the first's memory taken. On their own GPUs (the drafter on a GPU of
    its own, as on the 5-GPU host) or on CPU (a KV cache of a set size) they start together, which
    saves the drafter's start-up (about a minute on an H100: bench/results/engines_h100_s28/).
    """
    if cfg.engine != "vllm":
        return [specs]
    engines, front = specs[:-2], specs[-2:]
    if cfg.placement.is_shared_gpu:
        return [[spec] for spec in engines] + [front]
    return [engines, front]


class StopRequested(BaseException):
    """SIGINT/SIGTERM reached the launcher (BaseException: not swallowed by ``except Exception``)."""


def resolve_model_dir(model: str, timeout_s: float = 900.0) -> str:
    """Local HF dir of ``model`` (alias, dir or GGUF) via ``python -m specdec.models.loader resolve``.

    Raises:
        StackError: the loader failed.
    """
    proc = subprocess.run([sys.executable, "-m", "specdec.models.loader", "resolve", model],
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise StackError(f"cannot resolve model {model!r}: {proc.stderr.strip()}")
    return proc.stdout.strip().splitlines()[-1]


@dataclass
class RunningService:
    spec: ServiceSpec
    process: subprocess.Popen
    log_path: str
    is_serving: bool = False
    is_given_up: bool = False  # an ``OPTIONAL`` service out of restarts: left down, not watched
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class Stack:
    """A running set of services; use as a context manager (stops everything on exit)."""

    cfg: StackConfig
    run_dir: str = ""
    services: list[RunningService] = field(default_factory=list)
    mps: CudaMpsDaemon | None = None  # ``--cuda-mps``: started with the first engine, quit by ``stop``

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, model_dir: str, log=print, deadline: float | None = None) -> None:
        """Starts every service and waits until all are SERVING; ``deadline`` (``time.monotonic()``
        seconds): the whole start-up ends there at the latest, its start groups together (a
        benchmark's time budget), beside each group's ``cfg.startup_timeout_s``.

        Raises:
            StackError: a service died, or was not SERVING within ``cfg.startup_timeout_s`` or by
                ``deadline`` (the services started stay for ``stop``).
            InsufficientMemoryError: target + draft weights and KV caches exceed available memory
                (``check_memory``; nothing is started then).
        """
        check_memory(self.cfg, model_dir, log)
        for group in start_groups(self.cfg, build_service_specs(self.cfg, model_dir)):
            self.add_services(group, log, deadline)

    def add_services(self, specs: list[ServiceSpec], log=print, deadline: float | None = None) -> None:
        """Start ``specs`` in this stack and wait until every service is SERVING; e.g. a coordinator
        and gateway in front of engines another Stack runs (bench/gpu/gpu_stack.py switches modes
        without reloading the models). Raises StackError as ``start``."""
        self.run_dir = self.run_dir or os.path.join(self.cfg.runs_dir, time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(self.run_dir, exist_ok=True)
        for spec in specs:
            self.services.append(self._spawn(spec))
            log(f"started {spec.name} (pid {self.services[-1].process.pid}) -> {self.services[-1].log_path}")
        self._wait_serving(log, deadline)

    def _spawn(self, spec: ServiceSpec) -> RunningService:
        log_path = os.path.join(self.run_dir, f"{spec.name}.log")
        env = {**os.environ, **self._mps_env(spec), **spec.env}
        with open(log_path, "ab") as log_file:
            # die with the launcher and own CPU cores: set by a shim, not a preexec_fn (minedraft.child_exec)
            cpus = ",".join(map(str, spec.cpus)) or NO_CPUS
            argv = [sys.executable, "-m", "minedraft.child_exec", cpus, "--", *spec.argv]
            process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        return RunningService(spec, process, log_path)

    def _mps_env(self, spec: ServiceSpec) -> dict[str, str]:
        """``--cuda-mps``: the engines join the stack's MPS daemon, started on first need (CudaMpsError)."""
        if not spec.is_cuda_mps:
            return {}
        self.mps = self.mps or CudaMpsDaemon.started(self.run_dir)
        return self.mps.env

    def _wait_serving(self, log, deadline: float | None = None) -> None:
        ends = time.monotonic() + self.cfg.startup_timeout_s
        limit = f"within {self.cfg.startup_timeout_s:.0f} s"
        if deadline is not None and deadline < ends:
            ends, limit = deadline, "by the start-up deadline"
        while not all(s.is_serving for s in self.watched):
            self.check_alive()
            if time.monotonic() > ends:
                waiting = [s.spec.name for s in self.watched if not s.is_serving]
                raise StackError(f"not SERVING {limit}: {waiting}")
            for service in self.watched:
                if not service.is_serving and health_status(service.spec.address) == health_pb2.HealthCheckResponse.SERVING:
                    service.is_serving = True
                    log(f"{service.spec.name} SERVING on {service.spec.address}")
            time.sleep(POLL_S)

    @property
    def watched(self) -> list[RunningService]:
        """The services that must be up: all but those given up (``restart_exited``)."""
        return [s for s in self.services if not s.is_given_up]

    def service(self, name: str) -> RunningService:
        """The running service called ``name`` ("verifier", "drafter", "coordinator", "gateway").

        Raises:
            KeyError: no such service in this stack.
        """
        for service in self.services:
            if service.spec.name == name:
                return service
        raise KeyError(f"name: no service {name!r} in this stack")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to service ``name``'s process group (fault injection; the soak script and
        tests); waits for it to exit when ``sig`` is SIGKILL. Returns the pid signalled."""
        service = self.service(name)
        _signal_group(service.process, sig)
        if sig == signal.SIGKILL:
            service.process.wait()
        return service.process.pid

    def restart(self, name: str, log=print) -> None:
        """Start service ``name`` again with its original command line (same port, same log file,
        appended) after it exited, and wait until it is SERVING; a coordinator whose drafter gave up
        restarts in ``ar`` (it would otherwise wait for the drafter at start-up). Call it from a
        thread that lives as long as the stack: PR_SET_PDEATHSIG fires when the *thread* that
        spawned a child exits.

        Raises:
            StackError: it is still running, died again, or is not SERVING within ``startup_timeout_s``.
        """
        index = self.services.index(self.service(name))
        old = self.services[index]
        if old.process.poll() is None:
            raise StackError(f"{name} is still running (pid {old.process.pid})")
        spec = old.spec
        if name == "coordinator" and any(s.is_given_up and s.spec.name == "drafter" for s in self.services):
            spec = coordinator_spec(replace(self.cfg, mode="ar", max_num_seqs=self.cfg.num_engine_slots))
            log("the drafter gave up: the coordinator restarts in ar")
        self.services[index] = self._spawn(spec)
        log(f"restarted {name} (pid {self.services[index].process.pid})")
        self._wait_serving(log)

    def check_alive(self) -> None:
        """Raises StackError (with the log tail) when a service that must be up has exited."""
        for service in self.watched:
            code = service.process.poll()
            if code is not None:
                raise StackError(f"{service.spec.name} exited with code {code}; last lines of "
                                 f"{service.log_path}:\n{log_tail(service.log_path)}")

    def stop(self) -> None:
        """Drain and stop, front to back: SIGTERM the gateway and wait for it to exit (it lets open
        streams finish within its grace), then the coordinator, then the engines (still serving
        while the front drains), all within ``stop_timeout_s``; SIGKILL stragglers. Idempotent. A
        given-up service was reaped long ago: its pid may belong to another process by now, so it
        is not signalled."""
        deadline = time.monotonic() + self.cfg.stop_timeout_s
        self.services = self.watched
        for service in reversed(self.services):
            _signal_group(service.process, signal.SIGTERM)
            try:
                service.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for service in self.services:
            _signal_group(service.process, signal.SIGKILL)  # stragglers and grandchildren
            service.process.wait()
        self.services.clear()
        if self.mps is not None:  # after its clients are gone
            self.mps.stop()
            self.mps = None


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def restart_exited(stack: Stack, restarts: dict[str, int], log=print) -> list[str]:
    """Restart every exited service of ``stack`` named in ``RESTARTABLE`` (at most ``MAX_RESTARTS``
    times in a row each, counted in ``restarts``; reset after ``STABLE_S`` up) and wait until it is
    SERVING; an ``OPTIONAL`` one out of restarts is given up instead (left down, with a warning).
    Returns the names restarted. Call it from the thread that started the stack (``Stack.restart``).

    Raises:
        StackError: a service that is not restartable (verifier, gateway) or not optional and out of
            restarts has exited, or a restart failed (retried on the next call while restarts last).
    """
    restarted = []
    for service in list(stack.services):
        name, code = service.spec.name, service.process.poll()
        if code is None and time.monotonic() - service.started_at >= STABLE_S:
            restarts.pop(name, None)
        if code is None or service.is_given_up:
            continue
        if _is_fatal(service, restarts):
            stack.check_alive()  # raises with the log tail
        if restarts.get(name, 0) >= MAX_RESTARTS:
            _signal_group(service.process, signal.SIGKILL)  # its group's stragglers, while its pid is ours
            service.is_given_up = True
            log(f"warning: {name} gave up after {MAX_RESTARTS} restarts; serving without speculation "
                f"(exit code {code}, log {service.log_path})")
            continue
        restarts[name] = restarts.get(name, 0) + 1
        log(f"warning: {name} exited with code {code}; restart {restarts[name]}/{MAX_RESTARTS} "
            f"(log {service.log_path})")
        stack.restart(name, log)
        restarted.append(name)
    return restarted


def _is_fatal(service: RunningService, restarts: dict[str, int]) -> bool:
    """Whether ``service`` exited and ``minedraft up`` cannot go on without it: not restartable,
    or out of restarts and not optional."""
    name = service.spec.name
    is_out = restarts.get(name, 0) >= MAX_RESTARTS
    return (service.process.poll() is not None and not service.is_given_up
            and (name not in RESTARTABLE or (is_out and name not in OPTIONAL)))


def _restart_or_raise(stack: Stack, restarts: dict[str, int], log) -> None:
    """One supervision pass: a failed restart is logged and retried on the next pass (restarts are
    counted, so a service that keeps dying is given up or ends ``minedraft up``)."""
    try:
        restart_exited(stack, restarts, log)
    except StackError as exc:
        if any(_is_fatal(s, restarts) for s in stack.services):
            raise
        log(f"warning: restart failed, retrying: {str(exc).splitlines()[0]}")


def run_until_signal(cfg: StackConfig, log=print) -> int:
    """``minedraft up``: start the stack, serve until SIGINT/SIGTERM or a service that cannot be
    restarted dies (``restart_exited``), stop it.

    Returns the exit code: 0 after a signal, 1 when a service failed.
    """
    def on_signal(signum, frame) -> None:
        raise StopRequested(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    stack = Stack(cfg)
    try:
        stack.start(resolve_model_dir(cfg.target), log)
        for line in banner_lines(cfg, stack.run_dir):
            log(line)
        restarts: dict[str, int] = {}
        while True:
            _restart_or_raise(stack, restarts, log)
            time.sleep(POLL_S)
    except StopRequested:
        log("shutting down")
        return 0
    except (RuntimeError, subprocess.SubprocessError) as exc:  # StackError, memory, draft/model resolution
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the clean stop
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
