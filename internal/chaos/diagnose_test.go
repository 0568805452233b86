package chaos_test

import (
	"fmt"
	"strings"
	"time"

	"github.com/IBM/sarama"
)

// describeGroups says, for a stuck drain, who holds which partition of topic in each consumer group
// and how far each group has committed, next to the partitions' end offsets.
func describeGroups(brokers []string, topic string, groups []string) string {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_8_0_0
	cfg.Net.ReadTimeout = 5 * time.Second
	client, err := sarama.NewClient(brokers, cfg)
	if err != nil {
		return fmt.Sprintf("describe groups: %v", err)
	}
	defer client.Close()
	admin, err := sarama.NewClusterAdminFromClient(client)
	if err != nil {
		return fmt.Sprintf("describe groups: %v", err)
	}
	var b strings.Builder
	partitions, err := client.Partitions(topic)
	if err != nil {
		return fmt.Sprintf("describe groups: %v", err)
	}
	for _, p := range partitions {
		end, err := client.GetOffset(topic, p, sarama.OffsetNewest)
		fmt.Fprintf(&b, "partition %d: end offset %d %v\n", p, end, errOrEmpty(err))
	}
	descs, err := admin.DescribeConsumerGroups(groups)
	if err != nil {
		return b.String() + fmt.Sprintf("describe groups: %v", err)
	}
	for _, d := range descs {
		fmt.Fprintf(&b, "group %s: state %s, %d members\n", d.GroupId, d.State, len(d.Members))
		for id, m := range d.Members {
			a, err := m.GetMemberAssignment()
			var held []int32
			if err == nil && a != nil {
				held = a.Topics[topic]
			}
			fmt.Fprintf(&b, "  member %s (%s): partitions %v %v\n", id, m.ClientHost, held, errOrEmpty(err))
		}
		offsets, err := admin.ListConsumerGroupOffsets(d.GroupId, map[string][]int32{topic: partitions})
		if err != nil {
			fmt.Fprintf(&b, "  offsets: %v\n", err)
			continue
		}
		for _, p := range partitions {
			if blk := offsets.GetBlock(topic, p); blk != nil {
				fmt.Fprintf(&b, "  committed partition %d: %d\n", p, blk.Offset)
			}
		}
	}
	return b.String()
}

func errOrEmpty(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
