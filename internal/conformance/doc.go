// Package conformance runs Watermill's universal pub/sub test suite (pubsub/tests.TestPubSub)
// against txbox as a Watermill backend: a message.Publisher that writes each Publish call into the
// outbox in a transaction of its own, a running relay with its transactional KafkaSink, and a
// read_committed watermill-kafka Subscriber (kafkasub.SubscriberConfig).
//
// It has no code of its own outside its tests; see conformance_test.go for the composition and
// the features it declares, and why.
package conformance
