r"""Runs one zoo command as N processes on this machine, talking over 127.0.0.1.

    python launch/local.py --processes=2 --devices=4 -- \
        --config=experiments/mlp_digits.py:smoke --workdir=runs/mp --config.mesh.shape="(4,2)"

Each process gets K emulated CPU devices and the coordinator flags; everything after `--`
goes to every process unchanged. Output lines are prefixed with `[process i]`. If a process
fails, the others are stopped and the launcher exits with its code; SIGINT/SIGTERM are
passed on to every process (a SIGTERM makes zoo save and exit 0).
"""
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import cli

OWN_FLAGS = ('--cpu_devices', '--coordinator_address', '--num_processes', '--process_id')


def free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def commands(processes, devices, port, zoo_args, heartbeat_timeout):
  """The command line of each process."""
  return [[sys.executable, '-u', '-m', 'zoo.main', f'--cpu_devices={devices}',
           f'--coordinator_address=127.0.0.1:{port}', f'--num_processes={processes}',
           f'--process_id={i}', f'--heartbeat_timeout={heartbeat_timeout}', *zoo_args]
          for i in range(processes)]


def _die_with_parent():
  """In the child: SIGKILL it when the launcher dies, so no process outlives a killed launch."""
  libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6', use_errno=True)
  libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pump(index, stream):
  """Copies a child's output, prefixed; keeps draining even if our stdout breaks."""
  for line in stream:
    try:
      sys.stdout.write(f'[process {index}] {line}')
      sys.stdout.flush()
    except (BrokenPipeError, OSError):
      pass


def _stop(procs, grace, sig=signal.SIGTERM):
  for p in procs:
    if p.poll() is None:
      p.send_signal(sig)
  deadline = time.time() + grace
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def process_env(environ):
  """Each process's environment: `environ` without a CPU device count (--devices sets it);
  the user's other XLA flags reach every process."""
  env = {k: v for k, v in environ.items() if k not in ('XLA_FLAGS', 'JAX_NUM_CPU_DEVICES')}
  flags = [f for f in environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  env['PYTHONUNBUFFERED'] = '1'
  return env


def run(processes, devices, zoo_args, timeout=None, heartbeat_timeout=60, grace=10):
  """Starts the processes; returns the job's exit code (0 only if all exit 0)."""
  env = process_env(os.environ)
  procs = []
  for i, cmd in enumerate(commands(processes, devices, free_port(), zoo_args, heartbeat_timeout)):
    procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors='replace', start_new_session=True,
                                  preexec_fn=_die_with_parent))
    print(f'[launch] process {i}: pid {procs[-1].pid}', flush=True)
  pumps = [threading.Thread(target=_pump, args=(i, p.stdout), daemon=True) for i, p in enumerate(procs)]
  for t in pumps:
    t.start()
  forward = lambda signum, frame: [p.send_signal(signum) for p in procs if p.poll() is None]
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  start, code = time.time(), None
  try:
    while code is None:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        print(f'[launch] process {i} exited with {code}; stopping the others', flush=True)
        _stop(procs, grace, signal.SIGKILL)  # A SIGTERM would start a save that needs the dead peer.
        code = 128 - code if code < 0 else code  # Killed by signal N: exit 128 + N, like a shell.
      elif all(c == 0 for c in codes):
        code = 0
      elif timeout and time.time() - start > timeout:
        print(f'[launch] timeout after {timeout} s; stopping every process', flush=True)
        _stop(procs, grace)
        code = 124
      else:
        time.sleep(0.1)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for t in pumps:
      t.join(timeout=5)
  return code


def main():
  parser = cli.parser(__doc__)
  parser.add_argument('--processes', type=int, default=2)
  parser.add_argument('--devices', type=int, default=4, help='Emulated CPU devices per process.')
  parser.add_argument('--timeout', type=float, default=None, help='Seconds before every process is stopped.')
  parser.add_argument('--heartbeat_timeout', type=int, default=60,
                      help='Seconds after which a silent peer counts as dead.')
  cli.add_zoo_args(parser)
  args = parser.parse_args()
  zoo_args = cli.zoo_args(parser, args)
  clash = [a for a in zoo_args if '--' + a.lstrip('-').split('=')[0] in OWN_FLAGS]
  if clash:
    parser.error(f'{clash} are set by the launcher; remove them')
  if not (1 <= args.processes <= 64 and 1 <= args.devices <= 64):
    parser.error('--processes and --devices must be in [1, 64] (processes on this machine, '
                 'emulated CPU devices each)')
  if args.heartbeat_timeout < 1 or (args.timeout is not None and not 0 < args.timeout < 1e9):
    parser.error('--heartbeat_timeout and --timeout must be positive numbers of seconds')
  sys.exit(run(args.processes, args.devices, zoo_args, args.timeout, args.heartbeat_timeout))


if __name__ == '__main__':
  main()
