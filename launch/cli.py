"""What the launchers share: their argument parser, whose errors end as zoo's commands'
do (one `zoo: error:` line; argparse's usage status 2), and the zoo.main arguments given
after `--`. The launchers run on a controller that need not have zoo installed, so they
import nothing of it."""
import argparse
import sys


class Parser(argparse.ArgumentParser):
  """argparse's parser with one-line errors: `zoo: error: <what>; --help lists the flags`."""

  def error(self, message):
    sys.stderr.write(f'zoo: error: {self.prog}: {message}; --help lists the flags\n')
    sys.exit(2)


def parser(doc):
  """The launcher's parser, described by the first line of its docstring."""
  return Parser(description=doc.splitlines()[0])


def add_zoo_args(parser):
  parser.add_argument('zoo_args', nargs=argparse.REMAINDER, help='-- then the arguments of zoo.main')


def zoo_args(parser, args):
  """The arguments after `--`; a usage error (exit 2) if there are none."""
  rest = args.zoo_args[1:] if args.zoo_args[:1] == ['--'] else args.zoo_args
  if not rest:
    parser.error('give the zoo.main arguments after --')
  return rest
