// Calls the server's encoder.v1 with Node's gRPC client (@grpc/grpc-js, on Node's own HTTP/2, nghttp2), and
// prints what it got as one JSON object, for tests/service/test_server.py to check:
//   node client.js HOST:PORT PROTO_ROOT '["text", ...]'
// Encode with the texts; Encode naming a model that does not exist (its status); EncodeStream with two
// requests, the second naming that model (its answer carries the error, the stream goes on); a deadline.
"use strict";
const grpc = require("@grpc/grpc-js");
const loader = require("@grpc/proto-loader");

const [address, protoRoot, textsJson] = process.argv.slice(2);
const definition = loader.loadSync("encoder/v1/encoder.proto", {
  includeDirs: [protoRoot],
  keepCase: true,
  longs: Number,
  defaults: true,
});
const EncoderService = grpc.loadPackageDefinition(definition).encoder.v1.EncoderService;
const client = new EncoderService(address, grpc.credentials.createInsecure());
const texts = JSON.parse(textsJson);

function unary(request, seconds) {
  return new Promise((resolve) => {
    client.Encode(request, { deadline: Date.now() + seconds * 1000 }, (error, response) =>
      resolve(error ? { code: error.code, details: error.details } : { response }),
    );
  });
}

function streamed(requests) {
  return new Promise((resolve) => {
    const answers = [];
    const call = client.EncodeStream({ deadline: Date.now() + 30000 });
    call.on("data", (response) => answers.push(response));
    call.on("error", (error) => resolve({ code: error.code, details: error.details, answers }));
    call.on("end", () => resolve({ code: 0, answers }));
    for (const request of requests) call.write(request);
    call.end();
  });
}

(async () => {
  const out = {};
  const ok = await unary({ texts, normalize: false }, 30);
  out.embeddings = ok.response ? ok.response.embeddings.map((e) => e.values) : ok;
  out.model = ok.response ? [ok.response.model, ok.response.model_version] : null;
  out.not_found = await unary({ texts: ["x"], model: "nope" }, 30);
  const stream = await streamed([{ texts: [texts[0]] }, { texts: ["x"], model: "nope" }]);
  out.stream = {
    code: stream.code,
    widths: stream.answers.map((a) => a.embeddings.map((e) => e.values.length)),
    errors: stream.answers.map((a) => (a.error ? a.error.code : 0)),
  };
  client.close();
  console.log(JSON.stringify(out));
})();
