// Streams one request over HTTP/2 with Node's built-in http2 module and prints a JSON summary:
// status, response headers, every DATA chunk as received, and the trailers.
// usage: node h2_stream.mjs URL PATH JSON_BODY
import http2 from "node:http2";

const [url, path, body] = process.argv.slice(2);
const client = http2.connect(url);
client.on("error", (err) => { console.error(`connection error: ${err.message}`); process.exit(2); });
const req = client.request({ ":method": "POST", ":path": path, "content-type": "application/json" },
                           { waitForTrailers: false });
const out = { status: 0, headers: {}, chunks: [], trailers: {} };
req.on("response", (headers) => { out.status = headers[":status"]; out.headers = headers; });
req.on("data", (chunk) => { out.chunks.push(chunk.toString("utf8")); });
req.on("trailers", (trailers) => { out.trailers = trailers; });
req.on("end", () => { console.log(JSON.stringify(out)); client.close(); });
req.on("error", (err) => { console.error(`stream error: ${err.message}`); process.exit(3); });
req.end(body);
