// Calls the server's encoder.v1 with Java's gRPC client (grpc-java, on Netty's HTTP/2 codec), and prints
// what it got as one JSON object, for tests/service/test_grpc_java.py to check:
//
//   java -cp ... Client HOST:PORT TEXT...
//
// Encode with the texts; the same with packed float32 answers; Encode naming a model that does not exist
// (its status); EncodeStream with two requests, the second naming that model (its answer carries the
// error, the stream goes on). Every call carries a deadline (grpc-timeout, in grpc-java's units) and the
// client's request id, which the server sends back in the trailers.

import encoder.v1.Encoder.EncodeRequest;
import encoder.v1.Encoder.EncodeResponse;
import encoder.v1.EncoderServiceGrpc;
import io.grpc.ManagedChannel;
import io.grpc.ManagedChannelBuilder;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.MetadataUtils;
import io.grpc.stub.StreamObserver;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

public final class Client {
  private static final Metadata.Key<String> REQUEST_ID =
      Metadata.Key.of("x-request-id", Metadata.ASCII_STRING_MARSHALLER);

  private static String quoted(String s) {
    StringBuilder out = new StringBuilder("\"");
    for (char c : s.toCharArray()) {
      if (c == '"' || c == '\\') out.append('\\').append(c);
      else if (c < 0x20 || c > 0x7e) out.append(String.format("\\u%04x", (int) c));
      else out.append(c);
    }
    return out.append('"').toString();
  }

  private static String rows(List<float[]> rows) {
    List<String> out = new ArrayList<>();
    for (float[] row : rows) {
      List<String> values = new ArrayList<>();
      for (float v : row) values.add(Float.toString(v));
      out.add("[" + String.join(",", values) + "]");
    }
    return "[" + String.join(",", out) + "]";
  }

  private static String failure(StatusRuntimeException e) {
    Status s = e.getStatus();
    String message = s.getDescription() == null ? "" : s.getDescription();
    return "{\"code\":" + s.getCode().value() + ",\"message\":" + quoted(message) + "}";
  }

  private static List<float[]> values(EncodeResponse r) {
    List<float[]> out = new ArrayList<>();
    for (var e : r.getEmbeddingsList()) {
      float[] row = new float[e.getValuesCount()];
      for (int i = 0; i < row.length; i++) row[i] = e.getValues(i);
      out.add(row);
    }
    return out;
  }

  /** The packed answer: little-endian float32, one row of `dimensions` values a text. */
  private static List<float[]> unpacked(EncodeResponse r) {
    ByteBuffer bytes = r.getPacked().asReadOnlyByteBuffer().order(ByteOrder.LITTLE_ENDIAN);
    List<float[]> out = new ArrayList<>();
    while (bytes.remaining() >= 4 * r.getDimensions()) {
      float[] row = new float[r.getDimensions()];
      for (int i = 0; i < row.length; i++) row[i] = bytes.getFloat();
      out.add(row);
    }
    return out;
  }

  public static void main(String[] args) throws Exception {
    List<String> texts = Arrays.asList(args).subList(1, args.length);
    ManagedChannel channel = ManagedChannelBuilder.forTarget(args[0]).usePlaintext().build();
    Metadata sent = new Metadata();
    sent.put(REQUEST_ID, "java-1");
    AtomicReference<Metadata> trailers = new AtomicReference<>();
    EncoderServiceGrpc.EncoderServiceBlockingStub blocking =
        EncoderServiceGrpc.newBlockingStub(channel)
            .withInterceptors(
                MetadataUtils.newAttachHeadersInterceptor(sent),
                MetadataUtils.newCaptureMetadataInterceptor(new AtomicReference<>(), trailers));
    List<String> out = new ArrayList<>();

    EncodeRequest plain = EncodeRequest.newBuilder().addAllTexts(texts).setNormalize(false).build();
    EncodeResponse r = blocking.withDeadlineAfter(30, TimeUnit.SECONDS).encode(plain);
    out.add("\"embeddings\":" + rows(values(r)));
    out.add("\"model\":[" + quoted(r.getModel()) + "," + r.getModelVersion() + "]");
    out.add("\"request_id\":" + quoted(String.valueOf(trailers.get().get(REQUEST_ID))));

    r = blocking.withDeadlineAfter(30, TimeUnit.SECONDS).encode(plain.toBuilder().setPacked(true).build());
    out.add("\"packed\":" + rows(unpacked(r)));

    try {
      blocking.withDeadlineAfter(30, TimeUnit.SECONDS)
          .encode(EncodeRequest.newBuilder().addTexts("x").setModel("nope").build());
      out.add("\"not_found\":null");
    } catch (StatusRuntimeException e) {
      out.add("\"not_found\":" + failure(e));
    }

    List<String> widths = new ArrayList<>();
    List<String> errors = new ArrayList<>();
    AtomicReference<Status> ended = new AtomicReference<>();
    CountDownLatch done = new CountDownLatch(1);
    StreamObserver<EncodeRequest> requests =
        EncoderServiceGrpc.newStub(channel)
            .withDeadlineAfter(30, TimeUnit.SECONDS)
            .encodeStream(
                new StreamObserver<EncodeResponse>() {
                  @Override
                  public void onNext(EncodeResponse a) {
                    List<String> w = new ArrayList<>();
                    for (var e : a.getEmbeddingsList()) w.add(Integer.toString(e.getValuesCount()));
                    widths.add("[" + String.join(",", w) + "]");
                    errors.add(Integer.toString(a.hasError() ? a.getError().getCode() : 0));
                  }

                  @Override
                  public void onError(Throwable t) {
                    ended.set(Status.fromThrowable(t));
                    done.countDown();
                  }

                  @Override
                  public void onCompleted() {
                    ended.set(Status.OK);
                    done.countDown();
                  }
                });
    requests.onNext(EncodeRequest.newBuilder().addTexts(texts.get(0)).build());
    requests.onNext(EncodeRequest.newBuilder().addTexts("x").setModel("nope").build());
    requests.onCompleted();
    if (!done.await(60, TimeUnit.SECONDS)) throw new IllegalStateException("EncodeStream did not end");
    out.add(
        "\"stream\":{\"code\":" + ended.get().getCode().value()
            + ",\"widths\":[" + String.join(",", widths) + "]"
            + ",\"errors\":[" + String.join(",", errors) + "]}");

    channel.shutdown().awaitTermination(10, TimeUnit.SECONDS);
    System.out.println("{" + String.join(",", out) + "}");
  }
}
