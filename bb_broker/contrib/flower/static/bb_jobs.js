// The Jobs page (bb_jobs.html): its list, counts, charts and actions, refreshed from /jobs/data; served by the Jobs tab.
(function () {
  const root = document.getElementById('jobs-page');
  const base = root.dataset.base;
  const canAct = root.dataset.canAct === 'true';
  const statuses = ['queued', 'running', 'succeeded', 'failed'];
  const params = new URLSearchParams(location.search);
  const filterNames = JSON.parse(root.dataset.filterNames);
  const workerBase = root.dataset.workerBase;

  function isArgumentFilter(name) { return /^(kwargs|args|headers)\./.test(name); }
  function filterParams() {
    const out = new URLSearchParams();
    filterNames.forEach(function (name) { if (params.get(name)) out.set(name, params.get(name)); });
    params.forEach(function (value, name) { if (isArgumentFilter(name) && value !== '') out.set(name, value); });
    return out;
  }
  function text(value) { return value === null || value === undefined ? '' : String(value); }
  function cell(row, value, className) {
    const td = document.createElement('td');
    if (className) td.className = className;
    td.textContent = text(value);
    row.appendChild(td);
    return td;
  }
  function when(iso) { return iso ? iso.replace('T', ' ').slice(0, 19) : ''; }
  function notice(message, kind) {
    const box = document.getElementById('notice');
    box.className = 'alert alert-' + (kind || 'info');
    box.textContent = message;
  }

  function renderCounts(data) {
    const box = document.getElementById('status-counts');
    box.innerHTML = '';
    statuses.forEach(function (status) {
      const link = document.createElement('a');
      const query = filterParams();
      query.set('status', status);
      link.href = base + '?' + query.toString();
      link.className = 'btn btn-sm ' + (params.get('status') === status ? 'btn-primary' : 'btn-outline-primary');
      link.id = 'count-' + status;
      link.textContent = status + ' ' + data.statuses[status];
      box.appendChild(link);
    });
    const orphans = document.createElement('a');
    const orphanQuery = filterParams();
    orphanQuery.delete('status');
    orphanQuery.set('orphaned', '1');
    orphans.href = base + '?' + orphanQuery.toString();
    orphans.id = 'count-orphaned';
    orphans.title = 'running jobs whose lease ran out: their worker is gone or stuck';
    orphans.className = 'btn btn-sm ' + (params.get('orphaned') ? 'btn-danger' :
      (data.orphaned ? 'btn-outline-danger' : 'btn-outline-secondary'));
    orphans.textContent = 'orphaned ' + data.orphaned;
    box.appendChild(orphans);
    // Any other status a document has (written by hand or by another program): counted too, not a filter.
    Object.keys(data.statuses).forEach(function (status) {
      if (statuses.indexOf(status) >= 0) return;
      const badge = document.createElement('span');
      badge.className = 'btn btn-sm btn-outline-warning disabled count-unknown';
      badge.title = 'jobs whose status bb_broker does not know';
      badge.textContent = status + ' ' + data.statuses[status];
      box.appendChild(badge);
    });
    [['by-queue', 'byQueue', 'queue'], ['by-kind', 'byKind', 'kind']].forEach(function (spec) {
      if (!data[spec[1]]) return;  // asked for only while they are shown
      const table = document.getElementById(spec[0]);
      table.innerHTML = '';
      const head = table.insertRow();
      [spec[2]].concat(statuses).forEach(function (name) { cell(head, name); });
      Object.entries(data[spec[1]]).forEach(function (entry) {
        const row = table.insertRow();
        cell(row, entry[0] || '(none)');
        statuses.forEach(function (status) { cell(row, entry[1][status]); });
      });
    });
  }

  function renderQueues(data) {
    const body = document.querySelector('#queue-controls tbody');
    body.innerHTML = '';
    Object.entries(data.queues).forEach(function (entry) {
      const name = entry[0], queue = entry[1];
      const row = body.insertRow();
      row.dataset.queue = name;
      cell(row, name);
      cell(row, queue.queued);
      cell(row, queue.running);
      cell(row, queue.failed);
      cell(row, queue.paused ? 'paused by ' + queue.pausedBy : 'active', 'queue-state');
      const limits = [];
      if (queue.concurrency !== undefined) limits.push(queue.running + ' of ' + queue.concurrency + ' running');
      if (queue.rate !== undefined) limits.push('at most ' + queue.rate + ' started');
      if (queue.fair) limits.push('fair per key');
      cell(row, limits.length ? limits.join(', ') + ' (set by ' + queue.limitedBy + ')' : 'none', 'queue-limit');
      const actions = cell(row, '');
      if (canAct) {
        [['limit', 'Limit', 'concurrency', 'At most how many jobs of queue ' + name + ' running at once, across '
          + 'every worker? (empty: no limit)', queue.concurrency],
         ['rate', 'Rate', 'rate', 'At most how many jobs of queue ' + name + ' started per period, across every '
          + 'worker: 10/s, 10/m, 10/h or 10/d, with \u2018per key\u2019 after it for so many of each rate key? '
          + '(empty: no rate)', queue.rate]].forEach(function (spec) {
          const limitButton = document.createElement('button');
          limitButton.className = 'btn btn-sm btn-outline-secondary me-1';
          limitButton.textContent = spec[1];
          limitButton.dataset.change = spec[0];
          limitButton.addEventListener('click', async function () {
            const answer = prompt(spec[3], spec[4] === undefined ? '' : String(spec[4]));
            if (answer === null) return;
            const form = {};
            form[spec[2]] = answer.trim() || 'none';
            try {
              notice((await bbPost(base + '/queue/' + encodeURIComponent(name) + '/limit', form)).message, 'success');
            } catch (error) { notice(error.message, 'danger'); }
            refresh();
          });
          actions.appendChild(limitButton);
        });
        // Fairness is on or off: one click (confirmed) turns it over.
        const fairButton = document.createElement('button');
        fairButton.className = 'btn btn-sm btn-outline-secondary me-1';
        fairButton.textContent = queue.fair ? 'Unfair' : 'Fair';
        fairButton.dataset.change = 'fair';
        fairButton.addEventListener('click', async function () {
          const question = queue.fair ? 'Claim queue ' + name + ' in plain order again?'
            : 'Rotate the claims of queue ' + name + ' across its jobs\u2019 fair keys?';
          if (!confirm(question)) return;
          try {
            notice((await bbPost(base + '/queue/' + encodeURIComponent(name) + '/limit',
              {fair: queue.fair ? 'false' : 'true'})).message, 'success');
          } catch (error) { notice(error.message, 'danger'); }
          refresh();
        });
        actions.appendChild(fairButton);
        const button = document.createElement('button');
        const change = queue.paused ? 'resume' : 'pause';
        button.className = 'btn btn-sm ' + (queue.paused ? 'btn-success' : 'btn-outline-warning');
        button.textContent = queue.paused ? 'Resume' : 'Pause';
        button.dataset.change = change;
        button.addEventListener('click', async function () {
          if (!confirm(change + ' queue ' + name + ' for every worker?')) return;
          try {
            notice((await bbPost(base + '/queue/' + encodeURIComponent(name) + '/' + change)).message, 'success');
          } catch (error) { notice(error.message, 'danger'); }
          refresh();
        });
        actions.appendChild(button);
      }
    });
  }

  // A job's progress (its PROGRESS state's done and total, else its checkpoint's: clamped by the server, and here).
  function progressBar(progress) {
    const percent = Math.max(0, Math.min(100, Number(progress.percent) || 0));
    const outer = document.createElement('div');
    outer.className = 'progress job-progress mt-1';
    outer.style.height = '0.6rem';
    outer.setAttribute('role', 'progressbar');
    outer.setAttribute('aria-valuemin', '0');
    outer.setAttribute('aria-valuemax', '100');
    outer.setAttribute('aria-valuenow', String(percent));
    outer.title = text(progress.done) + ' of ' + text(progress.total) + ' (' + percent + '%)';
    const inner = document.createElement('div');
    inner.className = 'progress-bar';
    inner.style.width = percent + '%';
    outer.appendChild(inner);
    return outer;
  }

  function renderJobs(data) {
    const body = document.querySelector('#jobs-table tbody');
    body.innerHTML = '';
    data.jobs.forEach(function (job) {
      const row = body.insertRow();
      row.dataset.job = job.id;
      row.dataset.status = job.status;
      const link = document.createElement('a');
      link.href = base + '/job?id=' + encodeURIComponent(job.id);
      link.textContent = job.id;
      cell(row, '').appendChild(link);
      const kind = cell(row, job.kind);
      if (job.schedule) {
        // A job a periodic entry sent: a slot's (its unique key names the slot) or an operator's "run now".
        const beat = document.createElement('div');
        beat.className = 'small text-muted job-beat';
        const slot = text(job.uniqueKey).slice(('beat:' + job.schedule + ':').length);
        beat.textContent = 'beat ' + job.schedule + (job.uniqueKey ? ', slot ' + when(slot) : ', run now');
        kind.appendChild(beat);
      }
      cell(row, job.queue);
      const status = cell(row, job.status, 'job-status');
      if (job.orphaned) {
        row.dataset.orphaned = 'true';
        const badge = document.createElement('span');
        badge.className = 'badge bg-danger ms-1 job-orphaned';
        badge.title = 'its lease ran out: held by ' + text(job.leaseOwner) + ', which is gone or stuck';
        badge.textContent = 'orphaned';
        status.appendChild(badge);
      }
      if (job.progress) status.appendChild(progressBar(job.progress));
      cell(row, job.attempts);
      cell(row, when(job.createdAt));
      cell(row, when(job.updatedAt));
      cell(row, text(job.lastError).split('\n')[0].slice(0, 160), 'text-break');
    });
    if (!data.jobs.length) {
      const row = body.insertRow();
      const td = cell(row, 'No job matches this filter.');
      td.colSpan = 8;
    }
    const next = document.getElementById('next-page');
    const windowNote = document.getElementById('search-window');
    if (data.searchFrom) {
      windowNote.classList.remove('d-none');
      windowNote.textContent = 'The search inside arguments looked at the newest ' +
        data.searchWindow.toLocaleString('en') + ' jobs of the other filters only (from job ' + data.searchFrom +
        '): set a queue, kind or time to reach older ones.';
    } else {
      windowNote.classList.add('d-none');
    }
    if (data.next) {
      const query = filterParams();
      query.set('after', data.next);
      if (data.searchFrom) query.set('searchFrom', data.searchFrom);
      next.href = base + '?' + query.toString();
      next.classList.remove('d-none');
    } else {
      next.classList.add('d-none');
    }
    if (data.stoppedEarly) {
      notice('The search in the last errors stopped early (time limit): these are the matches found so far. ' +
        (data.next ? '"Older" searches on from the last one.' : ''), 'warning');
    }
  }

  function renderHolders(data) {
    const body = document.querySelector('#holders tbody');
    body.innerHTML = '';
    (data.holders || []).forEach(function (holder) {
      const row = body.insertRow();
      row.dataset.owner = text(holder.owner);
      const worker = cell(row, '', 'holder-worker');
      if (holder.worker) {
        const link = document.createElement('a');
        link.href = workerBase + encodeURIComponent(holder.worker);
        link.textContent = holder.worker;
        worker.appendChild(link);
      } else {
        worker.textContent = holder.owner === null || holder.owner === undefined ? '(no lease owner)' : 'not known to Flower';
      }
      cell(row, holder.owner, 'holder-owner text-break');
      cell(row, holder.running, 'holder-running');
      cell(row, holder.orphaned, 'holder-orphaned' + (holder.orphaned ? ' text-danger fw-bold' : ''));
      cell(row, when(holder.lastHeartbeat));
      cell(row, when(holder.since));
      const jobs = cell(row, '', 'holder-jobs');
      holder.jobs.forEach(function (id) {
        const link = document.createElement('a');
        link.href = base + '/job?id=' + encodeURIComponent(id);
        link.textContent = id;
        link.className = 'me-2';
        jobs.appendChild(link);
      });
      if (holder.running > holder.jobs.length) {
        jobs.appendChild(document.createTextNode('… ' + (holder.running - holder.jobs.length) + ' more'));
      }
    });
    if (!(data.holders || []).length) {
      cell(body.insertRow(), 'No job is running.').colSpan = 7;
    }
  }

  // The charts (uPlot, served with the page): drawn again at each refresh, in the colours of the page's theme.
  const charts = {};
  window.bbCharts = charts;  // each chart's data as drawn: [times, series...], for tests and the curious
  const chartSpecs = {
    'chart-finished': [['succeeded', 'succeeded', '#2e9e5b'], ['failed', 'failed for good', '#d9534f'],
      ['retried', 'retried', '#e0a030']],
    'chart-wait': [['waitP50', 'p50', '#3b82f6'], ['waitP95', 'p95', '#a855f7']],
    'chart-run': [['runP50', 'p50', '#3b82f6'], ['runP95', 'p95', '#a855f7']],
  };
  function drawChart(id, times, series) {
    const target = document.getElementById(id);
    if (charts[id] && charts[id].plot) charts[id].plot.destroy();
    const ink = getComputedStyle(document.body).color;
    const grid = {stroke: 'rgba(128, 128, 128, 0.25)'};
    const axis = {stroke: ink, grid: grid, ticks: grid};
    const data = [times].concat(chartSpecs[id].map(function (spec) { return series[spec[0]] || []; }));
    const plot = new uPlot({
      width: Math.max(target.clientWidth || 0, 300), height: 220,
      series: [{}].concat(chartSpecs[id].map(function (spec) {
        return {label: spec[1], stroke: spec[2], width: 2, spanGaps: false};
      })),
      axes: [axis, axis],
      legend: {show: true},
    }, data, target);
    target.querySelectorAll('.u-legend').forEach(function (legend) { legend.style.color = ink; });
    charts[id] = {data: data, plot: plot};
  }
  function seconds(value) { return value === null || value === undefined ? '' : value.toFixed(3); }
  async function refreshCharts() {
    if (!document.getElementById('charts').open || typeof uPlot === 'undefined') return;
    const query = filterParams();
    query.set('window', document.getElementById('chart-window').value);
    const by = document.getElementById('chart-by').value;
    if (by) query.set('by', by);
    const response = await fetch(base + '/stats?' + query.toString(), {credentials: 'same-origin'});
    const data = await response.json();
    const pending = document.getElementById('chart-pending');
    if (!response.ok) {
      pending.classList.add('d-none');
      notice(data.error || response.statusText, 'danger');
      return;
    }
    const picker = document.getElementById('chart-group');
    const groups = Object.keys(data.series);
    const chosen = groups.indexOf(picker.value) >= 0 ? picker.value : groups[0];
    picker.innerHTML = '';
    groups.forEach(function (name) {
      const option = document.createElement('option');
      option.value = name;
      option.textContent = name || '(none)';
      option.selected = name === chosen;
      picker.appendChild(option);
    });
    const waiting = (data.pending || []).length;
    pending.classList.toggle('d-none', !waiting);
    pending.textContent = waiting ? waiting + (waiting === 1 ? ' interval is' : ' intervals are') +
      ' still being summarized by ' + data.summarizing + ' and drawn as gaps: they fill in once its pass is over.' : '';
    const series = data.series[chosen] || {};
    const times = data.intervals.map(function (iso) { return Date.parse(iso) / 1000; });
    Object.keys(chartSpecs).forEach(function (id) { drawChart(id, times, series); });
    const body = document.querySelector('#chart-numbers tbody');
    body.innerHTML = '';
    data.intervals.forEach(function (iso, n) {
      if (!(series.succeeded || [])[n] && !(series.failed || [])[n] && !(series.retried || [])[n]) return;
      const row = body.insertRow();
      row.dataset.interval = iso;
      cell(row, when(iso));
      ['succeeded', 'failed', 'retried'].forEach(function (name) { cell(row, series[name][n]); });
      ['waitP50', 'waitP95', 'runP50', 'runP95'].forEach(function (name) { cell(row, seconds(series[name][n])); });
    });
    document.getElementById('charts').dataset.drawn = data.until;
  }
  ['chart-window', 'chart-by', 'chart-group'].forEach(function (id) {
    document.getElementById(id).addEventListener('change', refreshCharts);
  });
  document.getElementById('charts').addEventListener('toggle', refreshCharts);

  async function refresh() {
    const query = filterParams();
    if (params.get('after')) query.set('after', params.get('after'));
    if (params.get('searchFrom')) query.set('searchFrom', params.get('searchFrom'));
    if (document.getElementById('breakdowns').open) query.set('breakdowns', '1');
    try {
      const response = await fetch(base + '/data?' + query.toString(), {credentials: 'same-origin'});
      const data = await response.json();
      if (!response.ok) { notice(data.error || response.statusText, 'danger'); return; }
      renderCounts(data);
      renderQueues(data);
      renderHolders(data);
      renderJobs(data);
      document.getElementById('refreshed').textContent = 'updated ' + new Date().toLocaleTimeString();
      await refreshCharts();
    } catch (error) {
      notice('Cannot refresh: ' + error.message, 'danger');
    }
  }

  document.getElementById('first-page').href = base + '?' + filterParams().toString();
  document.getElementById('filters').addEventListener('submit', function () {
    // An argument search goes as its own parameter, `kwargs.invoice_id=42`: its value exactly as typed.
    const name = document.getElementById('f-arg-name').value.trim();
    const value = document.getElementById('f-arg-value').value;
    if (!name) return;
    const field = document.createElement('input');
    field.type = 'hidden';
    field.name = name;
    field.value = value;
    this.appendChild(field);
  });
  document.querySelectorAll('.remove-argument').forEach(function (button) {
    button.addEventListener('click', function () {
      const query = filterParams();
      query.delete(button.dataset.name);
      location.href = base + '?' + query.toString();
    });
  });
  document.getElementById('lookup').addEventListener('submit', function (event) {
    event.preventDefault();
    const id = document.getElementById('lookup-id').value.trim();
    if (id) location.href = base + '/job?id=' + encodeURIComponent(id);
  });
  document.querySelectorAll('[data-bulk]').forEach(function (button) {
    button.addEventListener('click', async function () {
      const action = button.dataset.bulk;
      try {
        const counted = await (await fetch(base + '/bulk/' + action + '/count?' + filterParams().toString(),
          {credentials: 'same-origin'})).json();
        if (counted.error) throw new Error(counted.error);
        if (!confirm(action + ' ' + counted.count + ' job(s) of this filter?')) return;
        const form = filterParams();
        form.set('expected', counted.count);
        form.set('asOf', counted.asOf);  // jobs arriving or changing after this count are left alone
        if (counted.searchFrom) form.set('searchFrom', counted.searchFrom);  // the window the count looked at
        notice((await bbPost(base + '/bulk/' + action, form)).message, 'success');
      } catch (error) { notice(error.message, 'danger'); }
      refresh();
    });
  });
  document.getElementById('breakdowns').addEventListener('toggle', refresh);
  refresh();
  setInterval(function () { if (document.getElementById('live').checked) refresh(); }, 3000);
})();
