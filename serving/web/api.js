// Talking to the server (serving/server.py). Every request carries the API key once the
// person has given one (serve.py --api-key); a 401 asks for it. Streamed replies are
// OpenAI's server-sent events: "data: {json}" blocks, then "data: [DONE]".

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export class Api {
  // onKeyNeeded(): called on a 401, to ask the person for the key
  constructor(onKeyNeeded) {
    this.key = null; // kept in this tab's memory only: never written to storage
    this.onKeyNeeded = onKeyNeeded;
  }

  async request(method, path, body, signal) {
    const headers = {};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (this.key) headers["Authorization"] = `Bearer ${this.key}`;
    const response = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) {
      const message = await errorMessage(response);
      if (response.status === 401) this.onKeyNeeded();
      throw new ApiError(response.status, message);
    }
    return response;
  }

  async get(path) {
    return (await this.request("GET", path)).json();
  }

  async post(path, body) {
    return (await this.request("POST", path, body)).json();
  }

  // The events of a streamed reply, each parsed, until [DONE]. An error event (the engine
  // failed, or the server is shutting down) is thrown. Aborting `signal` (the stop button)
  // closes the connection: the server notices and frees the request's blocks.
  async *stream(path, body, signal) {
    const response = await this.request("POST", path, body, signal);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) { // one event per blank-line-ended block
        const data = buffer.slice(0, end).split("\n")
          .filter((line) => line.startsWith("data: ")).map((line) => line.slice(6)).join("\n");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new ApiError(500, event.error.message);
        yield event;
      }
    }
  }
}

// The message of OpenAI's error object, {"error": {"message": ...}}, or the status.
async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch {
    return `HTTP ${response.status} ${response.statusText}`;
  }
}
