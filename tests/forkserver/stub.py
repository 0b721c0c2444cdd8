"""What ``mpiexec`` starts in a rank's place: hands itself to a preloaded server (server.py).

Sends argv, environment, working directory and all open descriptors to the server of its rank
slot, forwards the signals it gets to the rank, and ends as the rank ended: the same exit code,
or killed by the same signal. Imports only the standard library, so it starts in milliseconds.
"""
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT)


def open_descriptors(exclude: int) -> list[int]:
    listed = [int(name) for name in os.listdir("/proc/self/fd")]
    alive = []
    for fd in listed:
        if fd == exclude:
            continue
        try:
            os.fstat(fd)  # the listing's own directory descriptor is closed by now
        except OSError:
            continue
        alive.append(fd)
    return sorted(alive)


def receive(sock: socket.socket) -> dict:
    """The waiter's next message: the rank's pid, then how it ended."""
    reply = sock.recv(256)
    if not reply:
        sys.exit("bagua_mpi test forkserver: the server went away before the rank ended")
    return json.loads(reply)


def main() -> None:
    env = dict(os.environ)
    servers = env.pop("BAGUA_TEST_FORKSERVER_DIR")
    slot = int(env.get("PMI_RANK", "0")) % int(env.pop("BAGUA_TEST_FORKSERVER_SLOTS"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    path = os.path.join(servers, f"slot{slot}.sock")
    try:
        sock.connect(path)
    except OSError as error:
        sys.exit(f"bagua_mpi test forkserver: no server at {path} ({error}); "
                 "BAGUA_TEST_FORKSERVER=0 runs the tests without it")
    fds = open_descriptors(sock.fileno())
    request = {"argv": sys.argv[1:], "env": env, "cwd": os.getcwd(), "fds": fds}
    socket.send_fds(sock, [json.dumps(request).encode()], fds)
    rank = receive(sock)["pid"]
    for number in FORWARDED:
        signal.signal(number, lambda received, _frame: os.kill(rank, received))
    outcome = receive(sock)
    if "exit" in outcome:
        os._exit(outcome["exit"])
    number = outcome["signal"]
    if number not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler
        signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


if __name__ == "__main__":
    main()
