"""What the launchers share: the zoo.main arguments given after `--`."""
import argparse


def add_zoo_args(parser):
  parser.add_argument('zoo_args', nargs=argparse.REMAINDER, help='-- then the arguments of zoo.main')


def zoo_args(parser, args):
  """The arguments after `--`; a usage error (exit 2) if there are none."""
  rest = args.zoo_args[1:] if args.zoo_args[:1] == ['--'] else args.zoo_args
  if not rest:
    parser.error('give the zoo.main arguments after --')
  return rest
