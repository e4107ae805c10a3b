// The job page's canvas: the graph of the job's chains, groups and chord bodies (GET <jobs>/canvas?id=<job>, built by
// bb_broker/ops/canvas.py), drawn as an SVG: a column per depth, each step a box linked to its job page, coloured by
// status, failed or stuck steps marked, steps not yet published dashed. Every text is set as text, never as markup:
// names and ids come from documents anyone may have written.
(function () {
  'use strict';
  const section = document.getElementById('job-canvas');
  const page = document.getElementById('job-page');
  if (!section || !page) return;
  const SVG = 'http://www.w3.org/2000/svg';
  const BOX_W = 190, BOX_H = 46, COL_W = 240, ROW_H = 62, PAD = 12;
  const summary = document.getElementById('canvas-summary');
  const graph = document.getElementById('canvas-graph');

  function node(name, attributes, parent) {
    const element = document.createElementNS(SVG, name);
    Object.entries(attributes || {}).forEach(function ([key, value]) { element.setAttribute(key, String(value)); });
    if (parent) parent.appendChild(element);
    return element;
  }

  function text(parent, x, y, value, cls) {
    const element = node('text', {x: x, y: y, class: cls}, parent);
    element.textContent = value;
    return element;
  }

  function shortened(value, length) {
    const shown = String(value == null ? '?' : value);
    return shown.length > length ? shown.slice(0, length - 1) + '…' : shown;
  }

  function position(step) {
    return {x: PAD + step.depth * COL_W, y: PAD + step.row * ROW_H};
  }

  function draw(canvas) {
    const steps = Array.isArray(canvas.steps) ? canvas.steps : [];
    const byId = new Map(steps.map(function (step) { return [step.id, step]; }));
    const columns = Math.max(1, ...steps.map(function (step) { return step.depth + 1; }));
    const rows = Math.max(1, ...steps.map(function (step) { return step.row + 1; }));
    const width = 2 * PAD + (columns - 1) * COL_W + BOX_W, height = 2 * PAD + (rows - 1) * ROW_H + BOX_H;
    const svg = node('svg', {
      width: width, height: height, viewBox: '0 0 ' + width + ' ' + height,
      style: 'display: block; flex: none; max-width: none; min-width: ' + width + 'px',
      role: 'img', 'aria-label': 'the canvas of job ' + canvas.job,
    });
    node('style', {}, svg).textContent = [
      '.canvas-edge { stroke: #888; stroke-width: 1.5; fill: none; }',
      '.canvas-edge.kind-errback { stroke: #c62828; stroke-dasharray: 4 3; }',
      '.canvas-edge.kind-chord { stroke: #6a1b9a; }',
      '.canvas-step rect { stroke-width: 2; fill: #fff; }',
      '.status-succeeded rect { stroke: #2e7d32; fill: #e8f5e9; }',
      '.status-failed rect { stroke: #c62828; fill: #ffebee; }',
      '.status-running rect { stroke: #1565c0; fill: #e3f2fd; }',
      '.status-queued rect { stroke: #757575; fill: #f5f5f5; }',
      '.status-pending rect { stroke: #9e9e9e; stroke-dasharray: 5 4; }',
      '.canvas-step.marked rect { stroke: #c62828; stroke-width: 3; }',
      '.canvas-step.current rect { stroke-width: 4; }',
      '.step-name { font: 12px sans-serif; fill: #212121; }',
      '.step-state { font: 11px sans-serif; fill: #555; }',
      '.step-mark { font: bold 13px sans-serif; fill: #c62828; }',
    ].join('\n');
    (Array.isArray(canvas.edges) ? canvas.edges : []).forEach(function (edge) {
      const from = byId.get(edge.from), to = byId.get(edge.to);
      if (!from || !to) return;
      const a = position(from), b = position(to);
      const x1 = a.x + BOX_W, y1 = a.y + BOX_H / 2, x2 = b.x, y2 = b.y + BOX_H / 2;
      const bend = Math.max(20, (x2 - x1) / 2);
      node('path', {
        d: 'M' + x1 + ',' + y1 + ' C' + (x1 + bend) + ',' + y1 + ' ' + (x2 - bend) + ',' + y2 + ' ' + x2 + ',' + y2,
        class: 'canvas-edge kind-' + String(edge.kind).replace(/[^a-z]/g, ''),
        'data-from': edge.from, 'data-to': edge.to,
      }, svg);
    });
    const base = page.dataset.base;
    steps.forEach(function (step) {
      const at = position(step);
      const status = String(step.status).replace(/[^a-z]/g, '');
      const marks = Array.isArray(step.marks) ? step.marks : [];
      const classes = ['canvas-step', 'status-' + status];
      if (marks.length) classes.push('marked');
      if (step.jobId && step.jobId === page.dataset.job) classes.push('current');
      const group = step.jobId
        ? node('a', {href: base + '/job?id=' + encodeURIComponent(step.jobId)}, svg)
        : node('g', {}, svg);
      group.setAttribute('class', classes.join(' '));
      group.setAttribute('data-step', step.id);
      group.setAttribute('data-status', status);
      node('rect', {x: at.x, y: at.y, width: BOX_W, height: BOX_H, rx: 6}, group);
      const name = String(step.name || '?').split('.').pop();
      text(group, at.x + 8, at.y + 18, shortened(name, 26), 'step-name');
      const attempts = step.attempts ? ' · ' + step.attempts + ' attempt' + (step.attempts === 1 ? '' : 's') : '';
      text(group, at.x + 8, at.y + 36, shortened(status + attempts, 30), 'step-state');
      if (marks.length) text(group, at.x + BOX_W - 16, at.y + 18, '!', 'step-mark');
      const lines = [String(step.name || '?'), 'task ' + step.id, 'status ' + step.status + attempts];
      ['queue', 'createdAt', 'startedAt', 'finishedAt', 'error'].forEach(function (field) {
        if (step[field]) lines.push(field + ' ' + step[field]);
      });
      marks.forEach(function (mark) { lines.push(mark); });
      node('title', {}, group).textContent = lines.join('\n');
    });
    graph.replaceChildren(svg);
    const counts = Object.entries(canvas.counts || {}).map(function ([status, count]) {
      return count + ' ' + status;
    });
    summary.textContent = steps.length + ' step' + (steps.length === 1 ? '' : 's') + ' (' + counts.join(', ') + ')'
      + (canvas.truncated ? ': truncated, the canvas has more than ' + canvas.limit + ' steps' : '')
      + (canvas.edgesTruncated ? ': links truncated, the canvas has more than ' + canvas.edgeLimit + ' of them' : '')
      + '. ';
    if (canvas.root) {
      const list = document.createElement('a');
      list.id = 'canvas-list';
      list.href = base + '?root=' + encodeURIComponent(canvas.root);
      list.textContent = 'List the jobs of its root';
      summary.appendChild(list);
    }
  }

  fetch(section.dataset.url + '?id=' + encodeURIComponent(page.dataset.job), {credentials: 'same-origin'})
    .then(function (response) {
      return response.json().then(function (body) {
        if (!response.ok) throw new Error(body.error || response.statusText);
        return body;
      });
    })
    .then(draw)
    .catch(function (error) { summary.textContent = 'The canvas could not be read: ' + error.message; });
})();
