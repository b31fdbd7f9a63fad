"""Tests for fedjax_ssl.runs.logging_utils and fedjax_ssl.runs.plotting."""

import glob
import io
import math
import os
import struct

import jax.numpy as jnp
import matplotlib.image
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from fedjax_ssl.runs.logging_utils import MetricsWriter, progress, read_metrics
from fedjax_ssl.runs.plotting import plot_metrics, plot_runs, save_figure, time_axis

PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def _read_tb_events(tb_dir):
  """Parses TFRecord event files by hand: [u64 len][u32 crc][data][u32 crc]."""
  events = []
  for path in sorted(glob.glob(os.path.join(tb_dir, 'events.out.tfevents.*'))):
    with open(path, 'rb') as f:
      data = f.read()
    pos, file_events = 0, []
    while pos < len(data):
      (length,) = struct.unpack('<Q', data[pos:pos + 8])
      payload = data[pos + 12:pos + 12 + length]
      pos += 12 + length + 4
      event = event_pb2.Event()
      event.ParseFromString(payload)
      file_events.append(event)
    events.append(file_events)
  return events


def _scalars(file_events):
  return {(v.tag, e.step): v.simple_value for e in file_events for v in e.summary.value}


def test_write_converts_scalars_and_jsonl_format(tmp_path):
  with MetricsWriter(str(tmp_path)) as writer:
    record = writer.write(1, {'loss': jnp.float32(0.5), 'n_bytes': np.int64(1024),
                              'probe': {'test_acc': np.float64(0.25)}, 'lr': 0.125})
    writer.write(np.int32(2), {'loss': jnp.asarray(float('nan'))})
  assert record == {'round': 1, 'loss': 0.5, 'n_bytes': 1024, 'probe/test_acc': 0.25, 'lr': 0.125}
  assert type(record['loss']) is float and type(record['n_bytes']) is int
  with open(tmp_path / 'metrics.jsonl') as f:
    lines = f.read().split('\n')
  # Hand-written expected JSON text.
  assert lines[0] == ('{"round": 1, "loss": 0.5, "n_bytes": 1024, '
                      '"probe/test_acc": 0.25, "lr": 0.125}')
  assert lines[1] == '{"round": 2, "loss": NaN}' and lines[2] == ''
  records = read_metrics(str(tmp_path / 'metrics.jsonl'))
  assert records[0] == record and records[1]['round'] == 2 and math.isnan(records[1]['loss'])

  (tb_events,) = _read_tb_events(str(tmp_path / 'tb'))
  scalars = _scalars(tb_events)
  assert scalars[('loss', 1)] == 0.5 and scalars[('n_bytes', 1)] == 1024.0
  assert scalars[('probe/test_acc', 1)] == 0.25 and math.isnan(scalars[('loss', 2)])


def _run(workdir, rounds, value_fn, resume_from=None):
  with MetricsWriter(workdir) as writer:
    if resume_from is not None:
      writer.truncate_after(resume_from)
    for r in rounds:
      writer.write(r, {'loss': value_fn(r), 'acc': r / 8.0})


def test_truncate_after_gives_uninterrupted_log(tmp_path):
  reference_dir, resumed_dir = str(tmp_path / 'ref'), str(tmp_path / 'resumed')
  _run(reference_dir, range(1, 7), lambda r: 1.0 / r)
  # Interrupted run: got to round 5 (its rounds 4..5 are lost work), then a
  # torn write of round 6; resumed from the round-3 checkpoint.
  _run(resumed_dir, range(1, 6), lambda r: 1.0 / r + (0.5 if r > 3 else 0.0))
  with open(os.path.join(resumed_dir, 'metrics.jsonl'), 'a') as f:
    f.write('{"round": 6, "lo')
  assert [r['round'] for r in read_metrics(os.path.join(resumed_dir, 'metrics.jsonl'))] == [
      1, 2, 3, 4, 5]
  _run(resumed_dir, range(4, 7), lambda r: 1.0 / r, resume_from=3)

  with open(os.path.join(reference_dir, 'metrics.jsonl'), 'rb') as f:
    reference_bytes = f.read()
  with open(os.path.join(resumed_dir, 'metrics.jsonl'), 'rb') as f:
    assert f.read() == reference_bytes
  assert sorted(os.listdir(resumed_dir)) == ['metrics.jsonl', 'tb']  # no tmp file left
  expected = [{'round': r, 'loss': 1.0 / r, 'acc': r / 8.0} for r in range(1, 7)]
  assert read_metrics(os.path.join(resumed_dir, 'metrics.jsonl')) == expected

  # TensorBoard: the resumed event file starts with a purge marker at step 4, so
  # TensorBoard hides the first file's (wrong) events for steps >= 4.
  first, second = _read_tb_events(os.path.join(resumed_dir, 'tb'))
  starts = [e.step for e in second if e.HasField('session_log')
            and e.session_log.status == event_pb2.SessionLog.START]
  assert starts == [4]
  assert _scalars(first)[('loss', 4)] == np.float32(1.0 / 4 + 0.5)
  assert _scalars(second) == {(k, r): np.float32(v) for r in range(4, 7)
                              for k, v in (('loss', 1.0 / r), ('acc', r / 8.0))}


def test_truncate_after_minus_one_clears(tmp_path):
  _run(str(tmp_path), range(3), lambda r: 1.0)
  with MetricsWriter(str(tmp_path)) as writer:
    writer.truncate_after(-1)
  assert read_metrics(str(tmp_path / 'metrics.jsonl')) == []


def test_write_and_read_errors(tmp_path):
  with MetricsWriter(str(tmp_path)) as writer:
    with pytest.raises(ValueError, match="reserved key 'round'"):
      writer.write(1, {'round': 3})
    with pytest.raises(ValueError, match=r"metric 'z' has shape \(2,\)"):
      writer.write(1, {'z': jnp.zeros(2)})
    with pytest.raises(ValueError, match="metric 'a/name' = 'x' of type str"):
      writer.write(1, {'a': {'name': 'x'}})
  path = tmp_path / 'bad.jsonl'
  path.write_text('{"round": 1}\n{"round": 2, oops\n{"round": 3}\n')
  with pytest.raises(ValueError, match='bad.jsonl:2 is not a JSON object'):
    read_metrics(str(path))


def test_progress_bar_shows_live_metrics():
  out = io.StringIO()
  bar = progress(total=5, initial=2, desc='rounds', disable=False, file=out)
  bar.update(1)
  bar.set_metrics({'loss': jnp.float32(0.25), 'knn_acc': np.float64(0.5)})
  bar.close()
  text = out.getvalue()
  assert 'rounds' in text and '3/5' in text
  assert 'loss=0.25' in text and 'knn_acc=0.5' in text
  quiet = progress(total=5, disable=True)  # what a non-TTY run gets: calls are no-ops
  quiet.update(1)
  quiet.set_metrics({'loss': 1.0})
  quiet.close()


def _records():
  records = []
  for r in range(1, 21):
    rec = {'round': r, 'loss': 2.0 * math.exp(-r / 6.0)}
    if r % 5 == 0:
      rec['knn_acc'] = 0.1 + 0.03 * r
    records.append(rec)
  return records


def test_plot_metrics_png(tmp_path):
  out = str(tmp_path / 'plots' / 'curves.png')
  plotted = plot_metrics(_records(), out, keys=['loss', 'knn_acc', 'probe_acc'],
                         title='FedBYOL quick', hlines={'knn_acc': {'random init': 0.2}})
  assert plotted == ['loss', 'knn_acc']  # probe_acc absent from the records
  with open(out, 'rb') as f:
    assert f.read(8) == PNG_SIGNATURE
  image = matplotlib.image.imread(out)
  # Two 4.5 x 3.5 in panels at 100 dpi: 900 x 350 pixels (RGBA).
  assert image.shape == (350, 900, 4)
  rgb = image[..., :3].astype(np.float64)
  assert rgb.std() > 0.05  # not a blank canvas
  # Both panels have ink (dark line/text pixels) in their plotting area.
  left, right = rgb[60:300, 60:420], rgb[60:300, 510:870]
  assert (left.mean(-1) < 0.6).sum() > 100 and (right.mean(-1) < 0.6).sum() > 100

  without = str(tmp_path / 'no_hlines.png')
  plot_metrics(_records(), without, keys=['loss', 'knn_acc'], title='FedBYOL quick')
  assert not np.array_equal(matplotlib.image.imread(without), image)


def test_save_figure_replaces_the_file_whole_or_not_at_all(tmp_path):
  """A figure whose rendering fails half-way leaves the previous PNG as it was."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  out = tmp_path / 'sub' / 'fig.png'
  fig = Figure(figsize=(2, 1))
  fig.add_subplot().plot([0, 1], [1, 0])
  save_figure(fig, out, dpi=50)
  before = out.read_bytes()
  assert before[:8] == PNG_SIGNATURE and matplotlib.image.imread(out).shape == (50, 100, 4)

  def half_then_fail(path, **kwargs):
    del kwargs
    with open(path, 'wb') as f:
      f.write(PNG_SIGNATURE)
    raise OSError('disk full')
  fig.savefig = half_then_fail
  with pytest.raises(OSError, match='disk full'):
    save_figure(fig, out)
  assert out.read_bytes() == before
  assert sorted(p.name for p in out.parent.iterdir()) == ['fig.png']  # no half-written temp file


def test_plot_metrics_errors(tmp_path):
  with pytest.raises(ValueError, match=r"none of keys \['probe_acc'\].*available: \['knn_acc', 'loss'\]"):
    plot_metrics(_records(), str(tmp_path / 'x.png'), keys=['probe_acc'])
  with pytest.raises(ValueError, match=r"hlines keys \['acc'\]"):
    plot_metrics(_records(), str(tmp_path / 'x.png'), keys=['loss'], hlines={'acc': {'a': 1.0}})



def test_metrics_png_draws_the_random_init_and_raw_pixel_references():
  """The accuracy panels get both reference lines where both were measured; raw pixels are absent
  on the synthetic set (None) and have no kNN-monitor-only keys."""
  from fedjax_ssl.runs.shared_references import References
  lines = References({'knn_acc': 0.75, 'probe_acc': 0.82},
                     {'knn_acc': 0.81, 'probe_acc': 0.84, 'probe_acc_draws': [0.8]}
                     ).lines(['knn_acc', 'probe_acc', 'test_acc'])
  assert lines == {'knn_acc': {'random-init encoder': 0.75, 'raw pixels': 0.81},
                   'probe_acc': {'random-init encoder': 0.82, 'raw pixels': 0.84}}
  assert References({'knn_acc': 0.75}, None).lines(['knn_acc']) == {
      'knn_acc': {'random-init encoder': 0.75}}


def test_time_axis_and_plot_runs_against_virtual_time(tmp_path):
  """Rows with FedBuff's clock are drawn against it, the random-init row at time 0; rows without
  one keep rounds."""
  plain = [{'round': 0, 'knn_acc': 0.5}, {'round': 1, 'knn_acc': 0.6}]
  assert time_axis(plain) == ('round', plain)
  timed = [{'round': 0, 'knn_acc': 0.5}, {'round': 1, 'virtual_time': 2.5, 'knn_acc': 0.6}]
  key, records = time_axis(timed)
  assert key == 'virtual_time' and [r['virtual_time'] for r in records] == [0.0, 2.5]
  out = tmp_path / 'runs.png'
  plot_runs({'a': timed, 'b': [dict(r, knn_acc=0.7) for r in timed]}, str(out), 'knn_acc')
  assert matplotlib.image.imread(str(out)).shape[2] in (3, 4)
