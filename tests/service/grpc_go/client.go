// Calls the server's encoder.v1 and grpc.health.v1 with Go's gRPC client (grpc-go, on Go's own HTTP/2
// framing and HPACK, golang.org/x/net/http2), and prints what it got as one JSON object, for
// tests/service/test_grpc_go.py to check:
//
//	client HOST:PORT '["text", ...]'
//
// Encode with the texts; the same with packed float32 answers; Encode naming a model that does not exist
// (its status); EncodeStream with two requests, the second naming that model (its answer carries the
// error, the stream goes on); the health service. Every call carries a deadline (grpc-timeout, in
// Go's units).
package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "mhaserve/encoderpb"
)

type failure struct {
	Code    codes.Code `json:"code"`
	Message string     `json:"message"`
}

func failed(err error) *failure {
	s, _ := status.FromError(err)
	return &failure{s.Code(), s.Message()}
}

func values(r *pb.EncodeResponse) [][]float32 {
	out := [][]float32{}
	for _, e := range r.Embeddings {
		out = append(out, e.Values)
	}
	return out
}

// unpacked reads the packed answer: little-endian float32, one row of `dimensions` values a text.
func unpacked(r *pb.EncodeResponse) [][]float32 {
	out := [][]float32{}
	width := int(r.Dimensions)
	for i := 0; i+4*width <= len(r.Packed); i += 4 * width {
		row := make([]float32, width)
		for j := range row {
			row[j] = math.Float32frombits(binary.LittleEndian.Uint32(r.Packed[i+4*j:]))
		}
		out = append(out, row)
	}
	return out
}

func main() {
	address := os.Args[1]
	var texts []string
	if err := json.Unmarshal([]byte(os.Args[2]), &texts); err != nil {
		panic(err)
	}
	conn, err := grpc.Dial(address, grpc.WithInsecure(), grpc.WithBlock(), grpc.WithTimeout(30*time.Second))
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	client := pb.NewEncoderServiceClient(conn)
	within := func(d time.Duration) (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.Background(), d)
	}
	out := map[string]interface{}{}

	ctx, cancel := within(30 * time.Second)
	ctx = metadata.AppendToOutgoingContext(ctx, "x-request-id", "go-1")
	var trailer metadata.MD
	r, err := client.Encode(ctx, &pb.EncodeRequest{Texts: texts, XNormalize: &pb.EncodeRequest_Normalize{Normalize: false}}, grpc.Trailer(&trailer))
	cancel()
	if err != nil {
		out["embeddings"] = failed(err)
	} else {
		out["embeddings"] = values(r)
		out["model"] = []interface{}{r.Model, r.ModelVersion}
		out["request_id"] = trailer.Get("x-request-id")
	}

	ctx, cancel = within(30 * time.Second)
	r, err = client.Encode(ctx, &pb.EncodeRequest{Texts: texts, XNormalize: &pb.EncodeRequest_Normalize{Normalize: false}, Packed: true})
	cancel()
	if err != nil {
		out["packed"] = failed(err)
	} else {
		out["packed"] = unpacked(r)
	}

	ctx, cancel = within(30 * time.Second)
	_, err = client.Encode(ctx, &pb.EncodeRequest{Texts: []string{"x"}, Model: "nope"})
	cancel()
	out["not_found"] = failed(err)

	ctx, cancel = within(30 * time.Second)
	stream, err := client.EncodeStream(ctx)
	if err != nil {
		panic(err)
	}
	for _, req := range []*pb.EncodeRequest{{Texts: texts[:1]}, {Texts: []string{"x"}, Model: "nope"}} {
		if err := stream.Send(req); err != nil {
			panic(err)
		}
	}
	if err := stream.CloseSend(); err != nil {
		panic(err)
	}
	widths, errs := [][]int{}, []int32{}
	code := codes.OK
	for {
		a, err := stream.Recv()
		if err != nil {
			if err != io.EOF {
				code = status.Code(err)
			}
			break
		}
		w := []int{}
		for _, e := range a.Embeddings {
			w = append(w, len(e.Values))
		}
		widths = append(widths, w)
		if a.Error != nil {
			errs = append(errs, a.Error.Code)
		} else {
			errs = append(errs, 0)
		}
	}
	cancel()
	out["stream"] = map[string]interface{}{"code": code, "widths": widths, "errors": errs}

	ctx, cancel = within(30 * time.Second)
	h, err := grpc_health_v1.NewHealthClient(conn).Check(ctx, &grpc_health_v1.HealthCheckRequest{})
	cancel()
	if err != nil {
		out["health"] = failed(err)
	} else {
		out["health"] = h.Status.String()
	}

	text, err := json.Marshal(out)
	if err != nil {
		panic(err)
	}
	fmt.Println(string(text))
}
