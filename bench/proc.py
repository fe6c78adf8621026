"""Process facts read from /proc: CPU time of a process, the host's stolen time, who listens on
a port, core pinning.

Rules:
- CPU time is the sum of every thread's `sum_exec_runtime` (/proc/PID/task/*/schedstat,
  nanoseconds) when the kernel exposes it, cross-checked against utime+stime of
  /proc/PID/stat (clock ticks, which also count threads that have exited). When the tick
  figure is ahead by more than two ticks, threads died inside the window and it is used.
- `sum_exec_runtime` of a thread that is running is brought up to date only when it is
  descheduled or at a scheduler tick: read a process once it is idle (bench/loadgen.py waits
  for it), or a busy thread's last few milliseconds are missing.
- A process's CPU time includes its child processes' (read the same way), as a server's
  engine process works for it.
- Steal is the time a virtual machine's vCPUs wanted to run and the hypervisor ran someone
  else (/proc/stat, the `cpu` line's eighth field). A level's figures are only comparable with
  another's taken under a like steal: on a 2-vCPU VM the inter-token p99/p50 of one stream
  went from 1.4 to 3.7 when steal rose to ~6% of the CPU time, with the code unchanged.
- Nothing here raises for a process that is gone or not ours: callers get None and say so.
"""

import os
from typing import NamedTuple, Optional

CLOCK_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
TCP_LISTEN = "0A"


class CpuSample(NamedTuple):
    """One reading of a process's CPU clock."""
    stat_ns: int        # utime + stime, tick resolution, includes exited threads
    sched_ns: int       # sum of live threads' sum_exec_runtime, ns resolution (0 when unavailable)


class HostTicks(NamedTuple):
    """One reading of the host's CPU clock (/proc/stat, all CPUs, clock ticks)."""
    steal: int          # ticks the hypervisor gave this machine's vCPUs to others
    total: int          # ticks of every state: user, nice, system, idle, iowait, irq, softirq, steal


def read_host_ticks(path: str = "/proc/stat") -> Optional[HostTicks]:
    """The host's steal and total ticks so far, or None where /proc/stat has none (not Linux)."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]     # guest time is already counted in user
    return HostTicks(ticks[7], sum(ticks))


def steal_fraction(before: Optional[HostTicks], after: Optional[HostTicks]) -> Optional[float]:
    """The share of all CPUs' time stolen between two readings, or None without both or when
    no tick passed between them (a level shorter than the kernel's tick, 10 ms at 100 Hz)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)


def read_cpu(pid: int) -> Optional[CpuSample]:
    """The CPU time so far of the process and of its child processes (a server's engine
    process, tokenwire/engine_process.py, or a peer's workers are its work too), or None
    when the process cannot be read."""
    own = _read_one(pid)
    if own is None:
        return None
    stat_ns, sched_ns = own
    for child in _children(pid):
        sample = read_cpu(child)
        if sample is not None:
            stat_ns += sample.stat_ns
            sched_ns = sched_ns + sample.sched_ns if sched_ns and sample.sched_ns else 0
    return CpuSample(stat_ns, sched_ns)


def _read_one(pid: int) -> Optional[tuple]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: split after the last ')'
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_NS, _sched_ns(pid)     # utime + stime


def _children(pid: int) -> list:
    """Child process ids (/proc/PID/task/TID/children of every thread); none where the kernel lacks it."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                children += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return children


def _sched_ns(pid: int) -> int:
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread exited between listdir and open
    return total


def cpu_delta_ns(before: CpuSample, after: CpuSample) -> int:
    """CPU nanoseconds spent between two readings (see the module rules)."""
    stat = after.stat_ns - before.stat_ns
    sched = after.sched_ns - before.sched_ns
    if before.sched_ns == 0 or after.sched_ns == 0 or stat - sched > 2 * CLOCK_TICK_NS:
        return stat
    return sched


def pin_to_core(core: int, pid: int = 0) -> bool:
    """Pin a process (0: this one) to one core; False when the core is not available."""
    try:
        os.sched_setaffinity(pid, {core})
    except (OSError, AttributeError):
        return False
    return True


def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def listening_pid(port: int) -> Optional[int]:
    """The pid of the local process with a TCP socket listening on `port`, if it is visible."""
    inodes = _listen_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _owns_socket(entry, targets):
            return int(entry)
    return None


def _listen_inodes(port: int) -> set:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _owns_socket(pid: str, targets: set) -> bool:
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"{fd_dir}/{fd}") in targets:
                return True
        except OSError:
            continue
    return False
