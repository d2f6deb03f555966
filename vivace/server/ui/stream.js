// One streamed chat answer: POSTs /v1/chat/completions with stream=true through fetch, reads
// the server-sent events, and measures what the user sees: time to first token, the gaps
// between tokens (mean, p99, sparkline), tokens/s and the prompt tokens served from cache.
// Tokens are counted by the usage every chunk carries (continuous_usage_stats): a token that
// ends inside a character (an emoji, CJK) comes as a chunk without text, yet it is a token.
// A thinking model's reasoning (served with --reasoning-parser) shows in a folding "Thinking"
// block above the answer, open while the model thinks; its tokens count in the figures.
// Aborting the fetch closes the connection, which makes the server abort the request.

import { drawSparkline } from "./charts.js";
import { renderMarkdown } from "./markdown.js";

const ms = (v) => `${v.toFixed(v < 10 ? 2 : 1)} ms`;

function percentile(values, q) {
  if (!values.length) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.min(sorted.length - 1, Math.ceil(q * sorted.length) - 1)];
}

// Server-sent event payloads ("data: ..." lines) as they arrive on `body`.
async function* events(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data;
    }
  }
}

export class Answer {
  constructor(article) {
    this.article = article;
    this.content = article.querySelector(".content");
    this.reasoning = article.querySelector(".reasoning");
    this.reasoningText = article.querySelector(".reasoning-text");
    this.thought = "";
    this.sparkline = article.querySelector(".sparkline");
    this.text = "";
    this.gaps = [];
    this.tokens = 0;
    this.firstTokens = 0; // the tokens of the first chunk that had any
    this.frame = null;
  }

  stat(name, text) {
    this.article.querySelector(`[data-stat="${name}"]`).textContent = text;
  }

  // Streams the answer to `body`; resolves with its text (partial if stopped).
  async run(body, headers, signal) {
    this.start = performance.now();
    this.stat("state", "waiting for the first token");
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json", ...headers },
        body: JSON.stringify({ ...body, stream: true,
          stream_options: { include_usage: true, continuous_usage_stats: true } }), signal,
      });
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        throw new Error(error.error ? error.error.message : `HTTP ${response.status}`);
      }
      for await (const data of events(response.body)) {
        if (data === "[DONE]") break;
        this.onChunk(JSON.parse(data));
      }
      this.stat("state", this.finishReason ? `done (${this.finishReason})` : "done");
    } catch (error) {
      if (error.name === "AbortError") this.stat("state", "stopped");
      else this.fail(error.message);
    }
    this.render();
    return this.text;
  }

  fail(message) {
    this.stat("state", "error");
    const alert = document.createElement("p");
    alert.className = "error";
    alert.setAttribute("role", "alert");
    alert.textContent = `Error: ${message}`;
    this.article.insertBefore(alert, this.article.querySelector(".stats"));
  }

  onChunk(chunk) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) this.stat("cached", String(chunk.usage.prompt_tokens_details?.cached_tokens ?? 0));
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return;
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    if (chunk.timings && chunk.timings.ttft_ms != null) {
      const ttft = this.article.querySelector('[data-stat="ttft"]');
      ttft.title = `measured in the browser; the server's own: ${ms(chunk.timings.ttft_ms)}`;
    }
    const delta = choice.delta || {};
    // vLLM's newer name first; the same text comes under both
    const thinking = delta.reasoning ?? delta.reasoning_content;
    const generated = chunk.usage?.completion_tokens; // so far; a server without it: a chunk of text is a token
    const count = generated != null ? generated - this.tokens : (thinking || delta.content ? 1 : 0);
    if (count > 0) this.arrived(performance.now(), count);
    if (thinking || delta.content) this.append(thinking || "", delta.content || "");
    if ((count > 0 || thinking || delta.content) && this.frame === null) {
      this.frame = requestAnimationFrame(() => this.render());
    }
  }

  // `count` new tokens arrived at `now`.
  arrived(now, count) {
    if (this.tokens === 0) {
      this.first = now;
      this.firstTokens = count;
      this.stat("ttft", ms(now - this.start));
      this.stat("state", "streaming");
    } else {
      this.gaps.push(now - this.last);
    }
    this.last = now;
    this.tokens += count;
  }

  // Text of the answer: `thought` (reasoning) and `piece` (answer), either may be "".
  append(thought, piece) {
    if (thought && !this.thought) this.reasoning.open = true;
    this.thought += thought;
    if (piece && !this.text && this.thought) this.reasoning.open = false; // the answer begins: fold the thinking
    this.text += piece;
  }

  render() {
    if (this.frame !== null) cancelAnimationFrame(this.frame);
    this.frame = null;
    // A reader at the bottom of the conversation follows the answer as it grows; one who
    // scrolled up to read stays where they are.
    const log = this.article.parentElement;
    const following = log && log.scrollHeight - log.scrollTop - log.clientHeight < 32;
    this.content.innerHTML = renderMarkdown(this.text);
    if (this.thought) {
      this.reasoning.hidden = false;
      this.reasoningText.textContent = this.thought;
    }
    if (this.gaps.length) {
      this.stat("itl-mean", ms(this.gaps.reduce((a, b) => a + b, 0) / this.gaps.length));
      this.stat("itl-p99", ms(percentile(this.gaps, 0.99)));
      this.stat("tps", ((this.tokens - this.firstTokens) / ((this.last - this.first) / 1000)).toFixed(1));
    }
    if (this.tokens) this.stat("tokens", String(this.tokens));
    drawSparkline(this.sparkline, this.gaps);
    if (following) log.scrollTop = log.scrollHeight;
  }
}
