"""logging_utils.RunLog: library INFO goes to the run's log file, only warnings reach the console,
and runs made one after another in a process neither stack handlers nor share log files."""
import logging

from absl import logging as absl_logging
import pytest

from fedjax_ssl.runs import logging_utils


@pytest.fixture
def absl_app_logging():
  """The root logger as absl's app.run leaves it: absl's handler (to stderr) at INFO verbosity."""
  root = logging.getLogger()
  saved_handlers, saved_level = list(root.handlers), root.level
  absl_handler = absl_logging.get_absl_handler()
  root.addHandler(absl_handler)
  root.setLevel(logging.INFO)
  yield absl_handler
  root.handlers[:] = saved_handlers
  root.setLevel(saved_level)


def _orbax_like():
  return logging.getLogger('absl')  # orbax, tfds and the project log through absl's logger


def test_info_to_file_warnings_to_console(tmp_path, capfd, absl_app_logging):
  root = logging.getLogger()
  before = list(root.handlers)
  with logging_utils.RunLog() as log:
    _orbax_like().info('before the file is opened')
    log.open(tmp_path / 'train.log')
    _orbax_like().info('Saving checkpoint at step 1')
    logging.getLogger('jax._src.xla_bridge').info('Unable to initialize backend tpu')
    _orbax_like().warning('disk almost full')
    logging_utils.say('round 5/25  loss 0.5', echo=True)
    logging_utils.say('only in the file', echo=False)
  assert root.handlers == before and absl_app_logging in root.handlers
  out, err = capfd.readouterr()
  assert out == 'round 5/25  loss 0.5\n'
  assert 'disk almost full' in err
  assert 'Saving checkpoint' not in err and 'before the file' not in err and 'tpu' not in err
  text = (tmp_path / 'train.log').read_text()
  for line in ('before the file is opened', 'Saving checkpoint at step 1', 'Unable to initialize',
               'disk almost full', 'round 5/25  loss 0.5', 'only in the file'):
    assert line in text
  assert text.index('before the file') < text.index('Saving checkpoint')


def test_consecutive_runs_do_not_stack_handlers_or_share_files(tmp_path, capfd, absl_app_logging):
  root = logging.getLogger()
  before, level = list(root.handlers), root.level
  for run in ('a', 'b'):
    with logging_utils.RunLog() as log:
      log.open(tmp_path / f'{run}.log')
      files = [h.baseFilename for h in root.handlers if isinstance(h, logging.FileHandler)
               and h.baseFilename.startswith(str(tmp_path))]
      assert files == [str(tmp_path / f'{run}.log')]
      assert sum(isinstance(h, logging_utils.ConsoleHandler) for h in root.handlers) == 1
      _orbax_like().info('message of run %s', run)
    assert root.handlers == before and root.level == level
  _orbax_like().info('after both runs')
  a, b = (tmp_path / 'a.log').read_text(), (tmp_path / 'b.log').read_text()
  assert 'message of run a' in a and 'message of run b' not in a and 'after both' not in a
  assert 'message of run b' in b and 'message of run a' not in b and 'after both' not in b
  assert 'after both runs' in capfd.readouterr().err  # the console is the caller's again


def test_restored_after_an_exception(tmp_path):
  root = logging.getLogger()
  before, level = list(root.handlers), root.level
  absl_level = absl_logging.get_absl_logger().level
  with pytest.raises(RuntimeError):
    with logging_utils.RunLog() as log:
      log.open(tmp_path / 'x.log')
      raise RuntimeError('boom')
  assert root.handlers == before and root.level == level
  assert absl_logging.get_absl_logger().level == absl_level


def test_without_absl_handler_info_still_reaches_the_file(tmp_path, capfd):
  # A library user's process (no app.run): root at WARNING; the run's file still gets INFO.
  with logging_utils.RunLog() as log:
    log.open(tmp_path / 'x.log')
    _orbax_like().info('Saving checkpoint at step 2')
  assert 'Saving checkpoint at step 2' in (tmp_path / 'x.log').read_text()
  assert 'Saving checkpoint' not in capfd.readouterr().err
